"""Crash consistency of the persistent disk tier (specs/disk_persistence.md).

Every crash point of a scripted spill-heavy workload (SQLite style, through the fault
injecting store), and a few real kill -9 of a serving child process (make fuzz runs 200 per
round).  After each crash the directory is reopened: every byte served must be the KV
computed for its key, and every write that had returned must be found again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.crash import enumerate_crashes, faulted_slots, kill_loop, landed_slots
from statekv.ids import BlockHash, SlotId


@pytest.mark.parametrize("seed", [0, 1])
def test_every_crash_point_of_a_scripted_workload(tmp_path: Path, seed: int) -> None:
    result = enumerate_crashes(tmp_path, seed=seed)
    assert result.writes >= 20  # enough crash points to mean something
    assert result.journal_appends >= 5  # one per retention extension of the script, at least
    assert result.index_appends >= 20  # the index journal's appends are crash points too
    assert len(result.checks) == result.writes + result.journal_appends + result.index_appends
    assert result.wrong_bytes_while_running == 0
    for k, check in enumerate(result.checks, start=1):
        assert check.wrong_bytes == 0, f"crash point {k}: {check}"
        assert check.unknown_keys == 0, f"crash point {k}: {check}"
        assert check.lost == 0, f"crash point {k}: {check}"
        assert check.deadline_errors == (), f"crash point {k}: {check}"
        # The index journal never names a slot whose bytes a crash tore or never wrote.
        assert check.stale == 0, f"crash point {k}: {check}"
    # Deadlines lengthened on disk came back from the journal after later crashes, and an
    # append torn by a crash was found (mid-record or whole) and ignored.
    assert sum(c.recovery.journal.applied for c in result.checks) > 0
    assert sum(c.recovery.journal.torn for c in result.checks[result.writes:]) > 0
    assert sum(c.deadlines_checked for c in result.checks) > 0
    # The enumeration reached what it is for: restored blocks served after the crash, and
    # slots torn by the crash found by their checksums (never served).
    assert sum(c.verified for c in result.checks) > result.writes
    assert sum(c.served_blocks for c in result.checks) > 0
    assert sum(c.torn + c.recovery.corrupt + c.scan_torn for c in result.checks) > 0
    # The reopen after a crash used the index journal (no header scan), and appends torn by
    # a crash were found at its end and ignored.
    assert all(c.recovery.index.source == "journal" for c in result.checks)
    index_checks = result.checks[result.writes + result.journal_appends:]
    assert sum(c.recovery.index.torn for c in index_checks) > 0


def test_a_few_real_kill_9(tmp_path: Path) -> None:
    report = kill_loop(tmp_path / "cache", kills=3, seed=5, max_delay_s=0.5)
    totals = report.totals()
    assert totals["kills"] == 3
    assert totals["wrong_bytes"] == 0 and totals["unknown_keys"] == 0 and totals["lost"] == 0
    assert totals["stale_index_entries"] == 0
    assert totals["blocks_verified"] > 0 and totals["landed_before_kill"] > 0
    # Retained content written through at its release (on GPU or host when the child died)
    # is there after the restart: none of it lost.
    assert totals["retained_landed_before_kill"] > 0 and totals["retained_lost"] == 0


def test_kill_minus_nine_with_failing_and_torn_writes_never_serves_wrong_bytes(
    tmp_path: Path,
) -> None:
    # Every other child fails some writes (EIO, ENOSPC, short, torn -- some of them torn or
    # rotted while reporting success): what reopens is what landed, and nothing wrong is
    # served; a silently torn slot is found by its read-back and never served.
    report = kill_loop(tmp_path / "cache", kills=4, seed=7, max_delay_s=0.5,
                       write_faults=True)
    totals = report.totals()
    # The loop stops at the first child whose check failed: what failed comes first.
    assert totals["wrong_bytes"] == 0 and totals["unknown_keys"] == 0 and totals["lost"] == 0, \
        totals
    assert totals["stale_index_entries"] == 0 and totals["deadline_errors"] == 0, totals
    assert totals["kills"] == 4, totals
    assert totals["blocks_verified"] > 0


def test_the_write_log_keeps_only_writes_that_returned_and_were_not_overwritten(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log"
    a, b = "aa" * 32, "bb" * 32
    log.write_text(f"W 1\nL 1 {a}\nW 2\nL 2 {b}\nW 2\nW 3\nL 3 {a}\nW 4\nL 4 {b[:10]}")
    assert landed_slots(log) == {SlotId(1): BlockHash(bytes.fromhex(a)),
                                 SlotId(3): BlockHash(bytes.fromhex(a))}


def test_a_discarded_slot_need_not_be_found_again(tmp_path: Path) -> None:
    """A slot whose content left the cache (D: discarded, its FREE record may have landed)
    is not owed to the next open; a later write that returned is."""
    log = tmp_path / "log"
    a, b = "aa" * 32, "bb" * 32
    log.write_text(f"W 1\nL 1 {a}\nD 1\nW 2\nL 2 {b}\nD 2\nW 2\nL 2 {a}\n")
    assert landed_slots(log) == {SlotId(2): BlockHash(bytes.fromhex(a))}


def test_a_discard_after_a_faulted_write_leaves_the_slot_faulted(tmp_path: Path) -> None:
    # A discard does no I/O: the journal still names what the faulted write claimed until
    # its next append, so a child killed in between leaves a slot that is not stale.
    key = "ab" * 32
    log = tmp_path / "writes.log"
    log.write_text("".join([
        f"W 3 {key} -\n", "F 3\n", "D 3\n",          # failed, then discarded: faulted
        f"W 4 {key} -\n", f"L 4 {key} -\n", "T 4\n", "D 4\n",  # torn silently: faulted
        f"W 5 {key} -\n", "F 5\n", f"W 5 {key} -\n",  # written again after: not faulted
        f"W 6 {key} -\n", f"L 6 {key} -\n", "D 6\n",  # landed, then discarded: not faulted
    ]))
    assert faulted_slots(log) == {3, 4}
