"""Axis helpers shared by the benchmarks' plots (matplotlib is imported by the caller).

What they keep true, and what tests/test_plots.py checks: tick labels on a log axis are plain
numbers that do not overlap one another, and no axis is left with matplotlib's mixed
``2 x 10^1`` minor labels.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plain_log_axis(axis: Any, ticks: Sequence[float] | None = None) -> None:
    """A log `axis` (``ax.xaxis`` / ``ax.yaxis``) labelled with plain numbers: at `ticks`
    when given (say, the sweep's rates), else at 1, 2, 3 and 5 times each power of ten; minor
    ticks stay unlabelled."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    if ticks:
        axis.set_major_locator(FixedLocator(sorted(set(ticks))))
    else:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def tick_label_boxes(fig: Any, axis: Any) -> list[Any]:
    """Window extents of `axis`'s visible, non-empty major tick labels inside its view
    (the figure is drawn first, so the extents are the ones saved)."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    low, high = sorted(axis.get_view_interval())
    boxes = []
    for tick in axis.get_major_ticks():
        label = tick.label1
        if (label.get_visible() and label.get_text()
                and low * (1 - 1e-9) <= tick.get_loc() <= high * (1 + 1e-9)):
            boxes.append(label.get_window_extent(renderer))
    return boxes


def overlapping(boxes: Sequence[Any]) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def thin_tick_labels(fig: Any, axis: Any) -> None:
    """Blank every other major label of `axis` (then every third, ...) until its labels do
    not overlap; the ticks stay where they were, and the smallest label is kept."""
    if not overlapping(tick_label_boxes(fig, axis)):
        return
    low, high = sorted(axis.get_view_interval())
    locs = [v for v in axis.get_majorticklocs() if low <= v <= high]
    formatter = axis.get_major_formatter()
    texts = [formatter(v, i) for i, v in enumerate(locs)]
    for step in range(2, len(locs) + 1):
        axis.set_ticks(locs, [t if i % step == 0 else "" for i, t in enumerate(texts)])
        if not overlapping(tick_label_boxes(fig, axis)):
            return


def load_results(p: argparse.ArgumentParser, path: Path, bench: str, key: str,
                 kind: type) -> dict[str, Any]:
    """`--plot PATH`: the results file of `bench` (its `key` of type `kind` present), or one
    line naming the argument (``p.error``) for a file that cannot be read or is not one."""
    try:
        results: object = json.loads(path.read_text())
    except OSError as exc:
        p.error(f"argument --plot: cannot read {str(path)!r}: {exc.strerror}")
    except ValueError:
        p.error(f"argument --plot: {str(path)!r} is not JSON")
    if not isinstance(results, dict) or results.get("bench") != bench or not isinstance(
        results.get(key), kind
    ):
        p.error(f"argument --plot: {str(path)!r} is not a results file of bench.{bench}")
    return results
