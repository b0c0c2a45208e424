"""The benchmarks' plots, drawn from committed results files (Agg backend): every line and
marker style has a legend entry, log-axis tick labels are plain numbers that do not overlap,
bar and throughput axes are linear from 0, and the title names the machine, date and commit."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from bench import e2e
from bench.plots import plain_log_axis, thin_tick_labels
from bench.sweep import draw_case

RESULTS = Path(__file__).parent.parent / "bench" / "results"
SWEEPS = ["sweep-cpu-20261201-tiny.json", "sweep-h200-20261201-70b-class.json"]


def _load(name: str) -> dict[str, Any]:
    results: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return results


def _style(line: Line2D) -> tuple[str, str, bool]:
    """What tells a line apart in the legend besides its colour."""
    return (str(line.get_marker()), str(line.get_linestyle()),
            str(line.get_markerfacecolor()) == "none")


def _visible(line: Line2D) -> bool:
    return line.get_visible() and (str(line.get_linestyle()) not in ("None", "none", "")
                                   or str(line.get_marker()) not in ("None", "none", ""))


def _label_boxes(fig: Any, axis: Any) -> list[Any]:
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    low, high = sorted(axis.get_view_interval())
    return [t.label1.get_window_extent(renderer) for t in axis.get_major_ticks()
            if t.label1.get_visible() and t.label1.get_text()
            and low * 0.999 <= t.get_loc() <= high * 1.001]


def _assert_readable_log_axis(fig: Any, axis: Any) -> None:
    boxes = _label_boxes(fig, axis)
    assert len(boxes) >= 2, "a log axis needs at least two labelled ticks"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    texts = [t.get_text() for t in axis.get_majorticklabels() + axis.get_minorticklabels()]
    assert not any("$" in t or "10^" in t for t in texts), texts


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_plot_is_readable(name: str) -> None:
    results = _load(name)
    case = results["cases"][0]
    fig = draw_case(results, case, run=Path(name).stem)
    try:
        ax1, ax2 = fig.axes
        (legend,) = fig.legends
        styles = {_style(h) for h in legend.legend_handles if isinstance(h, Line2D)}
        labels = [t.get_text() for t in legend.get_texts()]
        assert any(label.startswith("SLO") for label in labels)
        assert any(label.startswith("offered") for label in labels)
        for ax in (ax1, ax2):
            for line in ax.get_lines():
                if _visible(line):
                    assert _style(line) in styles, (line.get_label(), _style(line), styles)
            assert ax.get_xscale() == "log"
            _assert_readable_log_axis(fig, ax.xaxis)
            assert "requests/s" in ax.get_xlabel()
        # Every configuration in the file, by name, and the dotted and dashed lines.
        for key, runs in case["runs"].items():
            if runs:
                assert any(label.startswith(f"({key})") for label in labels)
        assert ax1.get_yscale() == "log" and "(s" in ax1.get_ylabel()
        _assert_readable_log_axis(fig, ax1.yaxis)
        assert ax2.get_yscale() == "linear" and ax2.get_ylim()[0] == 0
        assert "tok/s" in ax2.get_ylabel()
        title = fig.get_suptitle()
        for part in (results["machine"], results["date"], results["commit"][:7], case["case"],
                     Path(name).stem):
            assert part in title, (part, title)
    finally:
        plt.close(fig)


def test_overlapping_tick_labels_are_thinned() -> None:
    fig, ax = plt.subplots(figsize=(2, 2))
    try:
        rates = [0.25 * 2 ** (i / 2) for i in range(13)]
        ax.plot(rates, rates)
        ax.set_xscale("log")
        plain_log_axis(ax.xaxis, rates)
        boxes = _label_boxes(fig, ax.xaxis)
        assert len(boxes) == len(rates)
        assert any(a.overlaps(b) for a, b in itertools.pairwise(boxes))
        thin_tick_labels(fig, ax.xaxis)
        _assert_readable_log_axis(fig, ax.xaxis)
        assert ax.xaxis.get_majorticklabels()[0].get_text() == "0.25"
    finally:
        plt.close(fig)


def test_e2e_plot_bars_start_at_zero_on_a_linear_axis() -> None:
    results = _load("e2e-h200-20261130.json")
    fig = e2e.draw(results)
    try:
        ttft, tiers = fig.axes
        for ax in (ttft, tiers):
            assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
            assert ax.get_ylabel()
        assert "(s)" in ttft.get_ylabel()
        assert all(bar.get_y() == 0 for bar in ttft.patches)
        assert ttft.patches and max(b.get_height() for b in ttft.patches) < ttft.get_ylim()[1]
        legend = tiers.get_legend()
        assert legend is not None
        labels = [t.get_text() for t in legend.get_texts()]
        # The host tier served nothing in this run: the legend says so.
        assert "from host (0 in every configuration)" in labels
        title = fig.get_suptitle()
        assert results["machine"] in title and results["date"] in title
        assert "not in this run: (e)" in title
    finally:
        plt.close(fig)


def test_e2e_plot_from_the_file_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "e2e-h200-20261130.json"
    shutil.copy(RESULTS / path.name, path)
    monkeypatch.setattr(sys, "argv", ["bench.e2e", "--plot", str(path)])
    assert e2e.main() == 0
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_plot_of_another_file_is_one_line(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"bench": "sweep", "cases": []}))
    monkeypatch.setattr(sys, "argv", ["bench.e2e", "--plot", str(path)])
    with pytest.raises(SystemExit) as exc:
        e2e.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--plot" in err, err
