"""What the config refuses for rollout.engine: vllm before anything starts (images; routing replay and the
checkpoint are in tests/test_config.py)."""

from __future__ import annotations

import pytest

from k3rl.config import ConfigError, JobConfig

VLLM = ["rollout.engine=vllm", "learner.routing_replay=false", "model.checkpoint=/ckpt"]


def test_vllm_refuses_envs_that_send_images():
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, [*VLLM, 'envs.train=[{"id": "k3rl/KeyLookup-v0"}, {"id": "k3rl/ChartMatch-v0"}]'])
    assert "envs.train.1.id: k3rl/ChartMatch-v0 puts images in the prompts" in str(e.value)
    assert "use rollout.engine: embedded" in str(e.value)
    with pytest.raises(ConfigError, match=r"envs\.eval\.0\.id: k3rl/ChartMatch-v0"):
        JobConfig.load(None, [*VLLM, 'envs.eval=[{"id": "k3rl/ChartMatch-v0"}]'])
    # text envs are served; the embedded engine takes images
    assert JobConfig.load(None, VLLM).rollout.engine == "vllm"
    assert JobConfig.load(None, ['envs.train=[{"id": "k3rl/ChartMatch-v0"}]']).rollout.engine == "embedded"
