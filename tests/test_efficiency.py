"""benchmarks/efficiency.py: the efficiency of an RL job against its parts measured alone (issue [19], item 4)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from k3rl.tracking import Tracker

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("efficiency", ROOT / "benchmarks" / "efficiency.py")
eff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eff)

TABLE = {1: 100.0, 100: 1_000.0, 10_000: 2_000.0}


def test_decode_rate_is_linear_in_log_batch_between_measured_batches():
    assert eff.decode_rate(TABLE, 1) == pytest.approx(100.0)
    assert eff.decode_rate(TABLE, 100) == pytest.approx(1_000.0)
    assert eff.decode_rate(TABLE, 10) == pytest.approx(550.0)  # halfway in log(batch) between 1 and 100
    assert eff.decode_rate(TABLE, 1_000) == pytest.approx(1_500.0)
    assert eff.decode_rate(TABLE, 100_000) == pytest.approx(2_500.0)  # the last segment's line beyond it


def test_efficiency_is_both_equivalent_seconds_over_the_step():
    # 550 tokens at 550 tok/s (batch 10) is 1 s of engine; 200 trained at 100 tok/s is 2 s of learner; step 6 s
    e = eff.efficiency(generated=550, trained=200, step_s=6.0, batch=10, decode=TABLE, learner=100.0)
    assert (e["engine_s"], e["learner_s"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert e["efficiency"] == pytest.approx(0.5)
    rows = [{"generated": 550, "trained": 200, "step_s": 6.0, "batch": 10},
            {"generated": 1_000, "trained": 100, "step_s": 2.0, "batch": 100}]
    out = eff.total(rows, TABLE, 100.0)  # one step of 8 s; the batch weighted by generated tokens
    assert out["batch"] == pytest.approx((10 * 550 + 100 * 1_000) / 1_550)
    expected = 1_550 / eff.decode_rate(TABLE, out["batch"]) + 300 / 100.0
    assert out["efficiency"] == pytest.approx(expected / 8.0)


def test_mlflow_run_gives_per_step_tokens_and_the_mean_decode_batch(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with Tracker(uri=uri, experiment="eff", run_name="job", run_dir=tmp_path / "runs" / "job") as t:
        for step in (1, 2, 3):  # cumulative engine counters, 640 decode tokens over 10 engine steps a step
            t.log_metrics({"time/step_s": 2.0, "throughput/rollout_tokens_per_s": 320.0, "tokens": 1_000.0 * step,
                           "engine/decode_tokens": 640.0 * step, "engine/steps": 10.0 * step}, step=step)
    name, rows = eff.from_mlflow("job", uri, skip=0, batch=None)
    assert [r["step"] for r in rows] == [2, 3]  # step 1 has no previous counters
    assert rows[0] == {"step": 2, "generated": 640.0, "trained": 2_000.0, "step_s": 2.0, "batch": 64.0}


def test_rl_gpus_json_finds_its_window_and_the_tokens():
    path = ROOT / "benchmarks/results/rl_job/2026-12-04_prefill_graphs_shared_buffers/job3.json"
    r = json.loads(path.read_text())[0]
    _, rows = eff.from_rl_json(path, batch=64)
    window = r["history"][4:]  # BENCHMARKS.md's "steps 5-16"
    assert rows[0]["step"] == "1gpu: steps 5-16"
    step_s = sum(m["time/step_s"] for m in window)
    assert rows[0]["step_s"] == pytest.approx(step_s)
    assert math.isclose(rows[0]["generated"] / step_s, r["gen_tokens_per_s"])
    assert rows[0]["trained"] == pytest.approx(r["train_tokens_per_s"] * sum(m["time/train_s"] for m in window))
