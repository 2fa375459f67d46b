"""`k3rl compare` (and `k3rl replay` by MLflow run name) against a real MLflow SQLite store."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from rich.console import Console
from test_store import make_episode
from typer.testing import CliRunner

from k3rl.compare import CompareError, compare_runs
from k3rl.replay import replay_command, resolve_run_dir
from k3rl.store import TrajectoryStore
from k3rl.tracking import Tracker

CURVES = {
    "grpo": [0.1, 0.3, 0.2, 0.6, 0.5],
    "ppo": [0.0, 0.1, 0.15, 0.2],
}
TAB_BLUE, TAB_ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours


@pytest.fixture(scope="module")
def mlstore(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    uri = f"sqlite:///{root}/mlflow.db"
    ids = {}
    for name, values in CURVES.items():
        t = Tracker(uri=uri, experiment="cmp", run_name=name, run_dir=root / "runs" / name)
        for step, v in enumerate(values, start=1):
            t.log_metrics({"reward/mean": v, "loss": 1 - v}, step=step)
        t.finish()
        ids[name] = t.run_id
    other = Tracker(uri=uri, experiment="other", run_name="sft-only")
    other.log_metrics({"sft/loss": 2.0}, step=0)
    other.finish("KILLED")
    ids["sft-only"] = other.run_id
    return uri, root, ids


def colours(png_path) -> set[tuple[int, int, int]]:
    img = np.asarray(Image.open(png_path).convert("RGB")).reshape(-1, 3)
    return {tuple(int(x) for x in px) for px in np.unique(img, axis=0)}


def test_compare_by_name_and_id(mlstore, tmp_path):
    uri, _, ids = mlstore
    out = tmp_path / "plots" / "cmp.png"
    console = Console(record=True, width=200, color_system=None)
    rows = compare_runs(["grpo", ids["ppo"], "grpo"], out=out, tracking_uri=uri, metric="reward/mean", console=console)
    assert [r["name"] for r in rows] == ["grpo", "ppo"]  # the repeated run is shown once
    grpo, ppo = rows
    assert grpo["run_id"] == ids["grpo"] and grpo["status"] == "FINISHED"
    assert (grpo["steps"], grpo["last_step"], grpo["final"], grpo["best"], grpo["best_step"]) == (5, 5, 0.5, 0.6, 4)
    assert grpo["mean"] == pytest.approx(sum(CURVES["grpo"]) / 5)
    assert (ppo["steps"], ppo["final"], ppo["best"]) == (4, 0.2, 0.2)
    text = console.export_text()
    assert "grpo" in text and "0.5000" in text and "0.6000 (4)" in text and "4 (to 4)" in text
    assert str(out) in text
    img = Image.open(out)
    assert img.format == "PNG" and img.size == (800, 450)
    found = colours(out)
    assert TAB_BLUE in found and TAB_ORANGE in found  # one curve per run


def test_compare_errors(mlstore, tmp_path):
    uri, _, ids = mlstore
    with pytest.raises(CompareError, match=r"no MLflow run named or with id 'nope'.*grpo"):
        compare_runs(["grpo", "nope"], out=tmp_path / "x.png", tracking_uri=uri)
    with pytest.raises(CompareError, match=r"run sft-only \(\w{8}\) has no metric 'reward/mean'; its metrics: sft/loss"):
        compare_runs(["sft-only"], out=tmp_path / "x.png", tracking_uri=uri)
    with pytest.raises(CompareError, match="no MLflow store at"):
        compare_runs(["grpo"], out=tmp_path / "x.png", tracking_uri=f"sqlite:///{tmp_path}/absent.db")
    assert not (tmp_path / "absent.db").exists()  # looking did not create an empty store
    with pytest.raises(CompareError, match="at least one run"):
        compare_runs([], out=tmp_path / "x.png", tracking_uri=uri)


def test_cli_compare_and_replay_by_run_name(mlstore, tmp_path):
    from k3rl.cli import app

    uri, root, ids = mlstore
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(app, ["compare", "grpo", "ppo", "--out", str(out), "--tracking-uri", uri,
                                      "--metric", "loss"])
    assert result.exit_code == 0, result.output
    assert out.is_file() and "loss" in result.output and "0.9000" in result.output  # ppo's best loss: 1 - 0.1

    # replay finds the run directory from an MLflow run name or id (its k3rl.run_dir tag)
    with TrajectoryStore(root / "runs" / "grpo") as store:
        store.append(make_episode(5))
    assert resolve_run_dir("grpo", runs_dir=tmp_path, tracking_uri=uri) == (root / "runs" / "grpo").resolve()
    assert resolve_run_dir(ids["grpo"], runs_dir=tmp_path, tracking_uri=uri) == (root / "runs" / "grpo").resolve()
    console = Console(record=True, width=200, color_system=None)
    assert replay_command("grpo", tracking_uri=uri, runs_dir=tmp_path, console=console) == 0
    assert "ep00005" in console.export_text()


def test_compare_draws_the_held_out_eval_in_a_second_panel(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for name, rise in (("lag0", 0.2), ("lag2", 0.1)):
        t = Tracker(uri=uri, experiment="cmp", run_name=name, run_dir=tmp_path / name)
        for step in range(0, 7):
            t.log_metrics({"reward/mean": 0.1 + rise * step / 6}, step=step)
            if step % 3 == 0:  # eval every 3 steps, step 0 before RL
                t.log_metrics({"eval/KeyLookup-v0/success": rise * step / 3, "eval/KeyLookup-v0/pass_at_4": 0.5,
                               "eval/KeyLookup-v0/reward": 0.3, "eval/policy_version": step + 1}, step=step)
        t.finish()
    out = tmp_path / "cmp.png"
    console = Console(record=True, width=200, color_system=None)
    rows = compare_runs(["lag0", "lag2"], out=out, tracking_uri=uri, console=console)
    assert rows[0]["eval"] == {"eval/KeyLookup-v0/success": pytest.approx(0.4), "eval/KeyLookup-v0/pass_at_4": 0.5}
    assert rows[1]["eval"]["eval/KeyLookup-v0/success"] == pytest.approx(0.2)
    text = console.export_text()
    assert "held-out evaluation" in text and "0.400 (6)" in text
    img = Image.open(out)
    assert img.format == "PNG" and img.size == (800, 800)  # two panels: the reward, then the eval curves
    pixels = np.asarray(img.convert("RGB"))
    bottom = {tuple(int(x) for x in px) for px in np.unique(pixels[420:].reshape(-1, 3), axis=0)}
    assert TAB_BLUE in bottom and TAB_ORANGE in bottom  # each run's eval curves in the lower panel

    # a run without eval metrics keeps the one-panel picture
    t = Tracker(uri=uri, experiment="cmp", run_name="plain", run_dir=tmp_path / "plain")
    t.log_metrics({"reward/mean": 0.1}, step=1)
    t.finish()
    assert compare_runs(["plain"], out=out, tracking_uri=uri, console=console)[0]["eval"] == {}
    assert Image.open(out).size == (800, 450)


def test_the_picture_draws_a_spread_band_a_whole_rate_axis_and_one_step_axis(tmp_path):
    """reward/mean with its reward/std band; a [0, 1] metric on the whole [0, 1] (a curve from 0.6 to 0.95 once
    filled the panel from 0.6); both panels on one x axis, labelled the same way."""
    from k3rl.compare import STEP_AXIS, RunCurve, figure, value_range

    points = [(s, 0.6 + 0.35 * s / 10) for s in range(11)]
    evals = {"eval/KeyLookup-v0/success": [(0, 0.6), (10, 0.9)]}
    curve = RunCurve("demo", "0" * 32, "FINISHED", points, evals, {s: 0.2 for s, _ in points})
    fig, (top, bottom) = figure([curve], {curve.run_id: "demo"}, "reward/mean")
    assert top.get_ylim() == pytest.approx((-0.03, 1.03)) and bottom.get_ylim() == pytest.approx((-0.03, 1.03))
    assert bottom.get_xlabel() == STEP_AXIS and top.get_xlabel() == "" and top.get_shared_x_axes().joined(top, bottom)
    band = [c for c in top.collections if "± 1 std" in c.get_label()]
    assert len(band) == 1
    ys = band[0].get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.4) and ys.max() == pytest.approx(1.15)  # 0.6 - 0.2 .. 0.95 + 0.2
    fig, (only,) = figure([RunCurve("x", "1" * 32, "FINISHED", points)], {"1" * 32: "x"}, "reward/mean")
    assert only.get_xlabel() == STEP_AXIS and not only.collections  # no std logged: no band
    # a metric outside [0, 1] is drawn from 0 (or from below it)
    assert value_range([2.0, 3.0])[0] < 0 < 3.0 < value_range([2.0, 3.0])[1]
    lo, hi = value_range([-1.0, 0.5])
    assert lo < -1.0 and 0.5 < hi

    # end to end: a run that logged reward/std gets its band in the PNG (matplotlib's first colour at alpha 0.15)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(uri=uri, experiment="cmp", run_name="banded", run_dir=tmp_path / "banded")
    for s, v in points:
        t.log_metrics({"reward/mean": v, "reward/std": 0.2}, step=s)
    t.finish()
    out = tmp_path / "band.png"
    compare_runs(["banded"], out=out, tracking_uri=uri, console=Console(record=True))
    band_colour = tuple(round(255 * 0.85 + c * 0.15) for c in TAB_BLUE)
    assert any(max(abs(a - b) for a, b in zip(px, band_colour, strict=True)) <= 2 for px in colours(out))
