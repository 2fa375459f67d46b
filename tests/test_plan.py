"""`k3rl plan` (k3rl/plan.py): its predictions against the numbers BENCHMARKS.md recorded on one H200, its
memory model's directions, the full K3's 256-GPU plan, the refusals and the command. CPU, no torch work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from k3rl.cli import app
from k3rl.model.config import K3Config
from k3rl.plan import (
    GPUS,
    USABLE,
    ModelShape,
    PlanError,
    decode_step_seconds,
    layer_seconds,
    learner_layout,
    plan_job,
    update_bytes,
    weight_sync_seconds,
)

H200 = GPUS["h200"]


def within(predicted: float, measured: float, tolerance: float = 0.25) -> bool:
    return abs(predicted / measured - 1) <= tolerance


@pytest.fixture(scope="module")
def small() -> ModelShape:
    return ModelShape(K3Config.preset("k3-small"), "bf16")


@pytest.fixture(scope="module")
def k3() -> ModelShape:
    return ModelShape(K3Config.preset("k3"), "mxfp4")


def test_k3_small_learner_step_on_one_h200(small):
    # BENCHMARKS.md "Learner", 2026-12-04: 65,520 tokens (16 x 4,095) in 295.3-306.9 ms, one micro-batch,
    # peak 65.7 GiB (benchmarks/learner.py --preset k3-small --device cuda)
    lay = learner_layout(small, H200, gpus=1, ep=1, cp=1, seqs=16, ckpt=False, host_opt=False, context=4095,
                         sequences=16, colocated=False)
    step = sum(lay.step_s.values())
    assert within(step, 0.2953) and within(step, 0.3069), step
    assert within(lay.total_gib, 65.66), lay.total_gib


def test_full_width_layer_out_of_sample(k3):
    # BENCHMARKS.md "Full-width layers", 2026-12-02: a KDA + LatentMoE layer, rank 0 of EP 8 (2 of the 16 routes
    # a token), 8K tokens, four AttnRes sources, fwd + bwd in 90.0 ms. Nothing was fitted on it.
    assert within(layer_seconds(k3, H200, 8192, routes_per_token=2, sources=4), 0.0900)


@pytest.mark.parametrize("batch, tok_s", [(1, 481.5), (64, 17_090.7), (256, 51_892.8)])
def test_k3_small_decode_rate_on_one_h200(small, batch, tok_s):
    # BENCHMARKS.md "Inference engine", eager layers in the graph, 2026-12-04: a 128-token prompt, 32 steps
    predicted = batch / decode_step_seconds(small, H200, batch, mean_context=128 + 16)
    assert within(predicted, tok_s), (batch, predicted)


def test_k3_small_weight_sync(small):
    # BENCHMARKS.md "Weight sync": a 452 MB bf16 k3-small update at 344 GB/s, NCCL between two H200s
    nbytes = update_bytes(small)
    assert within(nbytes, 452e6), nbytes
    assert within(nbytes / weight_sync_seconds(small, H200) / 1e9, 344), nbytes


def _gib(m, gpus=256, ep=64, cp=8):
    return learner_layout(m, H200, gpus, ep, cp, seqs=1, ckpt=True, host_opt=True, context=131072, sequences=256,
                          colocated=True).total_gib


def test_memory_per_rank_falls_with_more_gpus_and_more_ep(k3):
    by_gpus = [_gib(k3, gpus=g) for g in (64, 128, 256, 512)]
    assert by_gpus == sorted(by_gpus, reverse=True) and by_gpus[0] > by_gpus[-1]
    by_ep = [_gib(k3, ep=e) for e in (8, 16, 32, 64, 128)]
    assert by_ep == sorted(by_ep, reverse=True) and by_ep[0] > by_ep[-1]
    by_cp = [_gib(k3, cp=c) for c in (1, 2, 4, 8, 16)]
    assert by_cp == sorted(by_cp, reverse=True) and by_cp[0] > by_cp[-1]


def test_full_k3_on_256_h200_at_128k_fits():
    plan = plan_job("k3", "h200", 256, 131072, group_size=8, prompts_per_step=32, expert_precision="mxfp4")
    assert plan.fits, plan.problems
    assert plan.learner.total_gib <= H200.memory_gib * USABLE
    assert plan.learner.cp > 1 and plan.learner.checkpointing  # 128K tokens do not fit one rank's share
    assert 896 % plan.learner.ep == 0 and 256 % plan.learner.ep == 0
    assert plan.rollout.batch >= 1 and plan.rollout.decode_tok_s > 0
    assert 0 < plan.rollout.sync_s < 60 and plan.step_s > sum(plan.learner.step_s.values())


def test_eight_gpus_do_not_fit_and_say_what_to_change():
    plan = plan_job("k3", "h200", 8, 131072)
    assert not plan.fits
    assert any("learner" in p for p in plan.problems)
    assert any(s.startswith("more GPUs") for s in plan.suggestions), plan.suggestions


def test_bf16_experts_suggest_mxfp4_when_the_engines_do_not_fit():
    plan = plan_job("k3", "h100", 64, 131072, expert_precision="bf16")
    assert not plan.fits
    assert any("mxfp4" in s for s in plan.suggestions), plan.suggestions


def test_bad_input_is_refused_clearly():
    with pytest.raises(PlanError, match="unknown GPU kind 'a100'; known: b200, h100, h200"):
        plan_job(gpu="a100")
    with pytest.raises(PlanError, match="12 GPUs is not a whole number of 8-GPU nodes"):
        plan_job(gpus=12)
    with pytest.raises(PlanError, match="bf16 or mxfp4"):
        plan_job(expert_precision="fp8")


def test_the_command_prints_the_tables():
    runner = CliRunner()
    r = runner.invoke(app, ["plan", "--gpu", "h200", "--gpus", "256", "--context", "131072"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    for text in ("Layout", "Memory per rank", "Time per step", "weight sync", "decode rate", "fits", "FSDP 256 x EP"):
        assert text in r.output, text
    r = runner.invoke(app, ["plan", "--gpus", "8"], env={"COLUMNS": "160"})
    assert r.exit_code == 1 and "does not fit" in r.output and "more GPUs" in r.output
    r = runner.invoke(app, ["plan", "--gpu", "a100"])
    assert r.exit_code == 2
    assert "unknown GPU kind 'a100'; known: b200, h100, h200" in r.output + (r.stderr if r.stderr_bytes else "")
