"""The trace page in a real headless browser (Debian's chromium; .ci/run installs it).

Each check loads the page from disk the way a user opens it: it must run without a script
error (the page writes any error into its own DOM), draw one lane per block, apply filters
and the jump to the first error given in its URL fragment, and paint a screenshot that is
not blank.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import pytest

from io_actors.tracing.recorder import RecordKind, Trace, TraceRecord
from io_actors.tracing.tools import STATE_COLORS, STATE_TIERS, view_model, write_html
from statekv.lifecycle import BlockState
from tests.test_tracing import ODD_REQUEST, record_scenario

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1200, 760


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


BROWSER = find_browser()
if BROWSER is None:
    if os.environ.get("CI"):
        # CI must run this test: .ci/run installs chromium when it is missing.
        pytest.fail("chromium not found in CI (.ci/run should have installed it)",
                    pytrace=False)
    pytest.skip("no chromium on PATH: `apt-get install -y chromium` (as .ci/run does) to run "
                "the browser test", allow_module_level=True)


def browse(tmp_path: Path, url: str, *extra: str) -> str:
    assert BROWSER is not None
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    result = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
         "--hide-scrollbars", "--force-device-scale-factor=1",
         f"--window-size={WIDTH},{HEIGHT}", *extra, url],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def dump_dom(tmp_path: Path, page: Path, fragment: str = "") -> str:
    return browse(tmp_path, page.as_uri() + fragment, "--dump-dom")


def screenshot(tmp_path: Path, page: Path) -> Path:
    out = tmp_path / "shot.png"
    browse(tmp_path, page.as_uri(), f"--screenshot={out}")
    assert out.exists()
    return out


def body_attributes(dom: str) -> dict[str, str]:
    match = re.search(r"<body([^>]*)>", dom)
    assert match, dom[:500]
    return dict(re.findall(r'([\w-]+)="([^"]*)"', match.group(1)))


def lanes_in(dom: str) -> list[int]:
    return [int(b) for b in re.findall(r'class="row lane" data-block="(\d+)"', dom)]


def script_errors(dom: str) -> list[str]:
    return re.findall(r'<pre id="js-error">(.*?)</pre>', dom, flags=re.S)


# ---------------------------------------------------------------------- PNG pixels


def png_pixels(path: Path) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG (what chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _c, _f, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and color in (2, 6), (depth, color)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    pixels: list[tuple[int, int, int]] = []
    for y in range(height):
        start = y * (stride + 1)
        method = raw[start]
        line = bytearray(raw[start + 1:start + 1 + stride])
        if method == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif method == 2:
            for i in range(stride):
                line[i] = (line[i] + previous[i]) & 0xFF
        elif method == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + previous[i]) >> 1)) & 0xFF
        elif method == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b = previous[i]
                c = previous[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        for x in range(0, stride, channels):
            pixels.append((line[x], line[x + 1], line[x + 2]))
        previous = line
    return width, height, pixels


def hex_rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def painted(path: Path) -> tuple[float, set[str]]:
    """The share of pixels that are not the background, and the state colors present."""
    _w, _h, pixels = png_pixels(path)
    counts = Counter(pixels)
    background, _n = counts.most_common(1)[0]
    share = 1 - counts[background] / len(pixels)
    states = {state for state, color in STATE_COLORS.items()
              if state != "FREE" and counts[hex_rgb(color)] >= 50}
    return share, states


# ---------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return record_scenario(tmp_path_factory.mktemp("viewer")).snapshot()


@pytest.fixture(scope="module")
def page(recorded: Trace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_html(recorded, tmp_path_factory.mktemp("page") / "trace.html")


def test_page_loads_without_script_errors_and_draws_one_lane_per_block(
    recorded: Trace, page: Path, tmp_path: Path
) -> None:
    dom = dump_dom(tmp_path, page)
    assert script_errors(dom) == []
    attrs = body_attributes(dom)
    assert attrs.get("data-rendered") == "1" and "data-js-error" not in attrs
    blocks = sorted({r.block for r in recorded.records
                     if r.kind is RecordKind.TRANSITION and r.block is not None})
    assert lanes_in(dom) == blocks
    assert attrs["data-lanes"] == str(len(blocks))
    segments = len(re.findall(r'class="seg[ "]', dom))
    assert segments == sum(len(lane["segs"]) for lane in view_model(recorded, title="")["lanes"])
    assert "again" in dom and "&lt;/script&gt;&lt;b&gt;odd" in dom  # ids shown as text
    assert ODD_REQUEST not in dom


def test_filters_and_jump_to_first_error_from_the_url(
    recorded: Trace, page: Path, tmp_path: Path
) -> None:
    model = view_model(recorded, title="")
    every_lane = [lane["block"] for lane in model["lanes"]]
    touched = sorted({r.block for r in recorded.records
                      if r.request == "again" and r.block is not None})
    dom = dump_dom(tmp_path, page, "#request=again")
    assert script_errors(dom) == []
    assert lanes_in(dom) == touched
    assert len(touched) < len(every_lane)

    dom = dump_dom(tmp_path, page, "#blocks=0-1&tier=disk")
    assert set(lanes_in(dom)) <= {0, 1} and lanes_in(dom)

    dom = dump_dom(tmp_path, page, "#request=again&jump=error")
    assert script_errors(dom) == []
    assert body_attributes(dom).get("data-focused") == str(model["firstError"])
    assert 'class="mark error focus"' in dom  # the error's marker is highlighted
    # The jump clears filters that would hide the error.
    assert lanes_in(dom) == every_lane


def test_screenshot_shows_colored_lanes(page: Path, tmp_path: Path) -> None:
    share, states = painted(screenshot(tmp_path, page))
    assert share > 0.08, f"only {share:.1%} of the page is painted"
    assert {"ON_GPU", "RELEASED", "SPILLING", "ON_DISK"} <= states, states


def test_an_empty_trace_loads_and_says_so(tmp_path: Path) -> None:
    page = write_html(Trace(records=(), recorded=0), tmp_path / "empty.html")
    dom = dump_dom(tmp_path, page)
    assert script_errors(dom) == []
    assert body_attributes(dom).get("data-lanes") == "0"
    assert "This trace holds no records." in dom


def test_blank_and_broken_pages_are_caught(page: Path, tmp_path: Path) -> None:
    # The checks above must be able to fail: a blank page and a script error.
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    share, states = painted(screenshot(tmp_path, blank))
    assert share < 0.01 and states == set()
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace('"use strict";', '"use strict"; null.x;', 1))
    dom = dump_dom(tmp_path, broken)
    assert script_errors(dom) and "data-rendered" not in body_attributes(dom)


# ---------------------------------------------------------------------- every state


DRAWN_STATES = [state.name for state in BlockState if state is not BlockState.FREE]
"""Every state of the lifecycle table that holds memory (FREE is drawn as no span)."""


def every_state_trace() -> Trace:
    """Block i spends one second in the i-th state of the lifecycle table, then is freed."""
    records: list[TraceRecord] = []
    for block, state in enumerate(DRAWN_STATES):
        for time, before, after in ((0.0, "FREE", state), (1.0, state, "FREE")):
            records.append(TraceRecord(
                seq=len(records), time=time, kind=RecordKind.TRANSITION, actor="core",
                event="PLANTED", block=block, from_state=before, to_state=after,
            ))
    records.sort(key=lambda r: (r.time, r.seq))
    return Trace(records=tuple(records), recorded=len(records))


def test_every_state_of_the_lifecycle_table_has_a_color_and_a_tier() -> None:
    names = [state.name for state in BlockState]
    assert sorted(STATE_COLORS) == sorted(names), "a state without a color is an empty lane"
    assert sorted(STATE_TIERS) == sorted(names), "a state without a tier is never shown"
    assert all(STATE_TIERS[state] for state in DRAWN_STATES)
    assert len(set(STATE_COLORS.values())) == len(STATE_COLORS), "two states, one color"


def test_the_page_draws_and_lists_every_state(tmp_path: Path) -> None:
    page = write_html(every_state_trace(), tmp_path / "states.html")
    dom = dump_dom(tmp_path, page)
    assert script_errors(dom) == []
    assert lanes_in(dom) == list(range(len(DRAWN_STATES)))
    legend = re.search(r'id="legend"[^>]*>(.*?)</div>', dom, flags=re.S)
    assert legend, dom[:500]
    listed = re.findall(r"</i>(\w+)</span>", legend.group(1))
    assert [s for s in listed if s in STATE_COLORS] == DRAWN_STATES
    _share, states = painted(screenshot(tmp_path, page))
    assert states == set(DRAWN_STATES), f"drawn as empty lanes: {set(DRAWN_STATES) - states}"

