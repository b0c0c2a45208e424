"""bench.copy_calls on this machine, small: the admission's copies it times are the hazard
chain a recall into evicted pages makes, and every way is printed against its limits.
(That the ways copy right is tests/test_copy_runs.py's.)"""

from __future__ import annotations

import re

import pytest

from bench.copy_calls import admission_runs, main


def test_each_eviction_lands_in_the_host_page_the_recall_before_it_read() -> None:
    calls = admission_runs(pages=8, batch=3, seed=1)
    assert [len(runs) for runs in calls] == [6, 6, 4]
    gpu_out: list[int] = []
    for runs in calls:
        directions = [to_gpu for to_gpu, _pairs in runs]
        assert directions == [False, True] * (len(runs) // 2)
        for k in range(1, len(runs) // 2):
            (_page, into), = runs[2 * k][1]
            (source, _gpu), = runs[2 * k - 1][1]
            assert into == source
        for (_to_gpu, [(page, _host)]), (_back, [(_src, recalled)]) in zip(
                runs[0::2], runs[1::2], strict=True):
            assert page == recalled  # the recall goes into the page just evicted
            gpu_out.append(page)
    assert sorted(gpu_out) == list(range(8))  # every GPU page once


def test_every_way_is_printed_against_the_limit_and_the_per_run_calls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--block-kib", "32", "--pages", "16", "--batch-pages", "4",
                 "--repeat", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for way in ("calls", "engine"):
        assert re.search(rf"^  {way} +\d+\.\d\d GB/s = +\d+\.\d\dx +enqueue +\d+\.\d\d us a "
                         r"copy = +\d+\.\d\dx of one call a run$", out, re.M), way


def test_a_page_size_that_is_no_whole_number_of_layers_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--block-kib", "48", "--device", "cpu"])
    assert info.value.code == 2
    assert "--block-kib: 48 KiB" in capsys.readouterr().err
