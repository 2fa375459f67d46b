"""build_model: the one way the learner, the embedded engine and checkpoint loading build a K3."""

from __future__ import annotations

import pytest
import torch

from k3rl.config import JobConfig
from k3rl.model import K3Config, build_model, count_parameters, count_vision_parameters, save_hf
from k3rl.model.checkpoint import CheckpointMismatchError
from k3rl.model.model import FP32_PARAM_SUFFIXES


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_learner_and_engine_build_the_same_model():
    from k3rl.learner.trainer import Trainer
    from k3rl.rollout.engine import EmbeddedEngine

    job = JobConfig.load(None, ["model.seed=3", "model.overrides.num_experts=12"])
    trainer = Trainer.from_job(job)
    engine = EmbeddedEngine.from_preset(job.model.preset, seed=job.model.seed, overrides=job.model.overrides,
                                        background=False)
    assert engine.config.num_experts == 12 and trainer.model.config == engine.config
    assert _same(trainer.model, engine.model)
    assert not _same(build_model("k3-tiny", {"num_experts": 12}, seed=4), engine.model)  # the seed matters


def test_overrides_dtype_and_bad_input():
    model = build_model("k3-tiny", {"num_hidden_layers": 8}, dtype="bfloat16", seed=0)
    assert model.config.num_hidden_layers == 8 and len(model.model.layers) == 8
    for name, p in model.named_parameters():
        if p.is_floating_point():
            want = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else torch.bfloat16
            assert p.dtype == want, name
    # the same init whatever the dtype: bf16 is the rounded fp32 model
    fp32 = build_model("k3-tiny", {"num_hidden_layers": 8}, seed=0)
    assert torch.equal(model.lm_head.weight, fp32.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"\['num_layerz'\] are not K3Config fields"):
        build_model("k3-tiny", {"num_layerz": 2})
    with pytest.raises(ValueError, match="unknown K3 preset 'k4'"):
        build_model("k4")
    with pytest.raises(ValueError, match="unknown parameter dtype 'fp8'"):
        build_model("k3-tiny", dtype="fp8")


def test_full_k3_builds_on_meta_without_memory():
    model = build_model("k3", device="meta", dtype="bfloat16")
    assert all(p.is_meta for p in model.parameters())
    total, _ = count_parameters(model.config)
    assert sum(p.numel() for p in model.parameters()) == total + sum(count_vision_parameters(model.config))
    with pytest.raises(ValueError, match="meta device holds no values"):
        build_model("k3-tiny", device="meta", checkpoint="anywhere")


def test_checkpoint_weights_are_loaded_and_mismatches_named(tmp_path):
    saved = build_model("k3-tiny", seed=11)
    save_hf(saved, tmp_path / "ckpt")
    loaded = build_model(K3Config.from_hf(tmp_path / "ckpt"), seed=0, checkpoint=tmp_path / "ckpt")
    assert _same(loaded, saved)
    with pytest.raises(CheckpointMismatchError, match="mis-shaped"):
        build_model("k3-tiny", {"hidden_size": 96}, checkpoint=tmp_path / "ckpt")
