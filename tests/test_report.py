"""`rollout report`: one self-contained HTML file; headless Chromium lays it out and every plot draws."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from executor.report import PLOTS, hbars, write_report

REPO = Path(__file__).parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No network, no first-run work, no background services: the page must stand on its own.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",
]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM
    return subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _self_contained(text: str) -> None:
    assert not re.search(r"""\b(src|href)\s*=""", text), "the report references another resource"
    assert "<link" not in text and "@import" not in text and "url(" not in text
    # The SVG namespace is a name, never fetched; nothing else may look like an address.
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) <= {"http://www.w3.org/2000/svg"}


@pytest.mark.integration
def test_report_of_the_demo_run(demo_run, tmp_path):
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "executor.cli", "report", str(demo_run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    _self_contained(text)
    for key in PLOTS:
        svg = re.search(rf'<svg class="plot" data-plot="{key}".*?</svg>', text, re.S)
        assert svg and 'class="mark"' in svg.group(0), key
    for task in ("fix-add", "rate-limit-forever", "model-hangs"):
        assert task in text
    assert "rate_limit_exceeded" in text and "complete" in text


@pytest.mark.integration
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_report_renders_in_headless_chromium(demo_run, tmp_path):
    out = write_report(demo_run, tmp_path / "report.html")
    proc = _chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", out.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert 'data-rendered="yes"' in dom, "the page's load handler never ran"
    drawn = dict(re.findall(r'data-plot="(\w+)"[^>]*?data-drawn="(\d+)"', dom))
    assert set(drawn) == set(PLOTS), drawn
    assert all(int(n) > 0 for n in drawn.values()), drawn

    shot = tmp_path / "report.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=900,1400", out.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


@pytest.mark.integration
def test_report_of_a_run_still_going(partial_run, tmp_path):
    out = write_report(partial_run, tmp_path / "r.html")
    text = out.read_text()
    _self_contained(text)
    assert "running" in text and "<b>3</b><span>rows</span>" in text
    for key in PLOTS:
        assert f'data-plot="{key}"' in text


def test_a_plot_without_data_says_so():
    plot = hbars("reward", "Reward by task", "", ["a", "b"], [("mean", [0.0, 0.0], "#000")])
    assert "no data" in plot.svg and 'class="mark"' not in plot.svg
    plot = hbars("reward", "Reward by task", "", ["a", "b"], [("mean", [0.5, 1.0], "#000")])
    assert plot.svg.count('class="mark"') == 2
