"""The episode HTML page and `k3rl ui` in a real headless Chromium: screenshots, pixels, the rendered DOM.

Chromium comes from the system (Debian's `chromium` or `chromium-headless-shell`, which `make setup`
installs as root); without it these tests are skipped. Only loopback and file:// URLs are opened.
Screenshots are kept in the test's tmp_path (printed with -s).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from procs import alive, port_open, start_ui
from test_store import make_episode

from k3rl.render_html import render_episode_html
from k3rl.rollout.episode import run_oracle_episode
from k3rl.tracking import Tracker

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-headless-shell", "chromium-browser"))), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine: apt-get install chromium-headless-shell "
                             "(make setup installs it when run as root on Debian)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update", "--disable-default-apps"]


def chromium(url: str, profile: Path, *args: str, budget_ms: int = 0) -> str:
    """Run headless Chromium on `url` (with a fresh profile dir); its stdout."""
    budget = [f"--virtual-time-budget={budget_ms}"] if budget_ms else []
    done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *budget, *args, url],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(url: str, out: Path, size: str = "1280,2400", budget_ms: int = 0) -> Image.Image:
    chromium(url, out.with_suffix(".profile"), f"--window-size={size}", f"--screenshot={out}", budget_ms=budget_ms)
    print(f"screenshot: {out}")
    return Image.open(out).convert("RGB")


def dom(url: str, profile: Path, budget_ms: int = 0) -> str:
    """The document after its scripts ran (`--dump-dom`)."""
    return chromium(url, profile, "--window-size=1400,900", "--dump-dom", budget_ms=budget_ms)


def share(image: Image.Image, colour: tuple[int, int, int]) -> float:
    """The fraction of the image's pixels that are exactly `colour`."""
    return sum(n for n, c in image.getcolors(1 << 24) if c == colour) / (image.width * image.height)


def test_episode_page_renders_its_turns_and_images(tmp_path):
    episode = make_episode(7)  # a tool turn with a 4x3 green image (shown enlarged to 128x96)
    page = tmp_path / "episode.html"
    page.write_text(render_episode_html(episode, title="step 3 · episode ep00007"))
    shot = screenshot(page.as_uri(), tmp_path / "episode.png")
    assert share(shot, (255, 255, 255)) < 0.97  # something is drawn
    assert share(shot, (0, 255, 0)) * shot.width * shot.height >= 0.9 * 128 * 96  # the tool's image is visible
    document = dom(page.as_uri(), tmp_path / "dom.profile")
    assert "<title>step 3 · episode ep00007</title>" in document
    assert "tool call 1: <code>add</code>" in document and "result of <code>add</code>" in document


def test_replay_page_shows_the_group_the_reward_parts_and_the_tokens(tmp_path):
    """`k3rl replay --worst --html`: the page of a KeyLookup episode among its step, drawn by Chromium."""
    from rich.console import Console
    from test_replay import keylookup_run

    from k3rl.replay import replay_command

    page = tmp_path / "replay" / "worst.html"
    assert replay_command(str(keylookup_run(tmp_path)), worst=True, html=page,
                          console=Console(record=True, width=200)) == 0
    shot = screenshot(page.as_uri(), tmp_path / "replay.png", size="1400,1800")
    assert share(shot, (246, 246, 246)) > 0.05  # the list of the step's episodes beside the page
    assert share(shot, (255, 243, 176)) * shot.width * shot.height > 2000  # this episode marked, in the list and its group
    assert share(shot, (255, 128, 128)) > 0 and share(shot, (255, 214, 153)) > 0  # tokens shaded by probability
    document = dom(page.as_uri(), tmp_path / "replay.profile")
    assert "Its group: 4 samples of the same prompt" in document and "-0.438 / -0.250" in document
    assert "<td>valid_key</td>" in document and "parsed by the episode loop" in document
    assert 'title="id ' in document and "log-prob -3.2000 (p 0.041), policy v1" in document  # a token's, on hover
    walk = dom((page.parent / "worst_step1" / "kl-run-g0000000-s0.html").as_uri(), tmp_path / "walk.profile")
    assert "reward 1" in walk and 'href="../worst.html"' in walk  # the step's other pages, linked both ways


@pytest.mark.slow
def test_k3rl_ui_shows_the_runs_episode_trace(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri=uri, experiment="browser", run_name="browser-run")
    trace_id = tracker.log_episode_trace(run_oracle_episode("k3rl/KeyLookup-v0", seed=3), step=1)
    tracker.finish()
    ui, port, started = start_ui(uri, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}/#/experiments/{tracker.experiment_id}"

        runs = ""
        for budget in (15000, 40000):  # the app fetches its data after loading: a slow machine needs longer
            runs = dom(f"{base}/runs", tmp_path / "runs.profile", budget_ms=budget)
            if "browser-run" in runs:
                break
        assert "browser-run" in runs and "MLflow" in runs

        trace_page = f"{base}/traces?selectedEvaluationId={trace_id}"
        document = ""
        for budget in (15000, 40000):
            document = dom(trace_page, tmp_path / "trace.profile", budget_ms=budget)
            if "tool lookup #1" in document:
                break
        for span in ("episode k3rl/KeyLookup-v0", "turn 1", "tool lookup #1", "turn 2", "reward"):
            assert span in document, f"span {span!r} is not on the trace page"
        shot = screenshot(trace_page, tmp_path / "ui-trace.png", size="1400,900", budget_ms=15000)
        assert share(shot, (255, 255, 255)) < 0.97 and len(shot.getcolors(1 << 24)) > 50  # a drawn page
    finally:
        if ui.poll() is None:
            ui.send_signal(signal.SIGTERM)
            try:
                ui.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for pid in alive({ui.pid, *started}, within_s=20):  # only what this test started
            os.kill(pid, signal.SIGKILL)
    assert not port_open(port)

