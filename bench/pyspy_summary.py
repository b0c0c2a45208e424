"""Where a py-spy raw profile's samples went, per thread, and how many of one function's
samples were waiting to take the interpreter lock back.

    python -m bench.pyspy_summary PROFILE.txt [--within PagedDecoder.forward] [--top 8]

PROFILE.txt is py-spy's ``--format raw`` output recorded with ``--threads`` (and, for the
lock figure, ``--native --idle``): one line per distinct stack, ``frame;frame;... count``,
its first frame naming the thread.  ``bench/on_gpu.sh profile-latency`` with
``PROFILE_NATIVE=1`` writes one.

A sample *waits for the lock* when its innermost frames show a thread blocked retaking the
interpreter lock: a condition wait (``pthread_cond_timedwait`` / ``pthread_cond_wait``)
under pybind11's ``gil_scoped_release`` destructor or ``gil_scoped_acquire`` (torch lets
the lock go around each call's dispatch and takes it back after), under CPython's
``take_gil`` / ``PyEval_RestoreThread`` / ``PyEval_AcquireThread``, or under torch's
tensor deallocation, which takes the lock to drop a Python reference.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import attrs

from bench.flags import OneLineParser, int_at_least

_WAITS = ("pthread_cond_timedwait", "pthread_cond_wait")
_LOCK_RETAKERS = ("gil_scoped_release::~gil_scoped_release", "gil_scoped_acquire",
                  "take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread",
                  "THPVariable_dealloc")


@attrs.frozen
class Stack:
    thread: str
    frames: tuple[str, ...]
    count: int


def read_stacks(lines: Iterable[str]) -> Iterator[Stack]:
    """The stacks of a raw profile; a line that is not ``frames count`` is refused."""
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        text, _, count = line.rpartition(" ")
        frames = text.split(";")
        # A thread sampled with no frames at all (idle in native code, without --native)
        # is its thread frame alone: py-spy names threads "thread (TID): NAME".
        alone = len(frames) == 1 and frames[0].startswith("thread (")
        if not text or not count.isdigit() or (len(frames) < 2 and not alone):
            raise ValueError(f"line {number} is not a py-spy raw stack with --threads: "
                             f"{line[:80]!r}")
        yield Stack(thread=frames[0], frames=tuple(frames[1:]), count=int(count))


def _name(frame: str) -> str:
    """A frame without its file and line: ``func (file.py:12)`` -> ``func``."""
    return frame.split(" (", 1)[0]


def waits_for_lock(frames: Sequence[str], depth: int = 4) -> bool:
    """Whether the innermost frames are a thread blocked retaking the interpreter lock."""
    inner = frames[-depth:]
    names = [_name(f) for f in inner]
    if not any(w in n for n in names for w in _WAITS):
        return False
    return any(r in n for n in names for r in _LOCK_RETAKERS)


@attrs.frozen
class Summary:
    threads: dict[str, int]
    """Samples per thread."""
    top: dict[str, list[tuple[str, int]]]
    """Per thread, its innermost Python frames by samples, most first."""
    within: int
    """Samples whose stack holds the `within` function (0 without one)."""
    within_waiting: int
    """Of those, samples waiting to take the interpreter lock back."""


def summarize(stacks: Iterable[Stack], *, within: str | None, top: int) -> Summary:
    threads: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inside = waiting = 0
    for stack in stacks:
        threads[stack.thread] += stack.count
        python = [f for f in stack.frames if ".py:" in f]
        leaves[stack.thread][_name(python[-1]) if python else "(native only)"] += stack.count
        if within is not None and any(_name(f) == within for f in stack.frames):
            inside += stack.count
            if waits_for_lock(stack.frames):
                waiting += stack.count
    return Summary(
        threads=dict(threads.most_common()),
        top={t: leaves[t].most_common(top) for t in threads},
        within=inside, within_waiting=waiting,
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.pyspy_summary",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="py-spy --format raw output (--threads)")
    parser.add_argument("--within", default=None,
                        help="a function (as py-spy names it, e.g. PagedDecoder.forward): "
                             "its samples, and how many waited for the interpreter lock")
    parser.add_argument("--top", type=int_at_least(1), default=8,
                        help="innermost frames per thread")
    args = parser.parse_args(argv)
    try:
        with args.profile.open(encoding="utf-8", errors="replace") as f:
            summary = summarize(read_stacks(f), within=args.within, top=args.top)
    except OSError as exc:
        parser.error(f"argument profile: cannot read {args.profile}: {exc.strerror}")
    except ValueError as exc:
        parser.error(f"argument profile: {exc}")
    for thread, samples in summary.threads.items():
        print(f"{samples:8d}  {thread}")
        for frame, n in summary.top[thread]:
            print(f"{n:14d}  {frame}")
    if args.within is not None:
        share = summary.within_waiting / summary.within if summary.within else 0.0
        print(f"{args.within}: {summary.within} samples, {summary.within_waiting} "
              f"({share:.0%}) waiting to take the interpreter lock back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
