"""`model.expert_precision: mxfp4` (K3's precision recipe, k3rl/model/moe.py): the setting and its refusals,
the straight-through gradient of the quantised expert GEMMs, and that the embedded engine and the learner
compute the same model under it."""

from __future__ import annotations

import pytest

from k3rl.config import ConfigError, JobConfig


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, list(overrides))
    return str(e.value)


def test_the_setting_reaches_the_model_and_bad_values_are_refused_by_path():
    assert JobConfig.load(None, []).model.k3_config().expert_precision == "bf16"
    cfg = JobConfig.load(None, ["model.expert_precision=mxfp4"])
    assert cfg.model.k3_config().expert_precision == "mxfp4"
    assert cfg.model.k3_overrides["expert_precision"] == "mxfp4"  # what the engines and the learner build from
    assert "model.expert_precision: Input should be 'bf16' or 'mxfp4' (got 'fp8')" in _refusal("model.expert_precision=fp8")
    assert "model.overrides.expert_precision: set model.expert_precision instead" in _refusal(
        "model.overrides.expert_precision=mxfp4")
    msg = _refusal("model.expert_precision=mxfp4", "model.overrides.moe_intermediate_size=48")
    assert "moe_intermediate_size (48) must be multiples of 32" in msg
    msg = _refusal("model.expert_precision=mxfp4", "learner.expert_parallel=2", "learner.data_parallel=fsdp",
                   "learner.world_size=2")
    assert "learner.expert_parallel: learner.expert_parallel=2 shards the routed experts" in msg

