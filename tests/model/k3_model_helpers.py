"""Shared helpers for the K3 model tests: tiny configs and models with non-trivial weights."""

from __future__ import annotations

import torch

from k3rl.model import K3Config, K3ForCausalLM


def make_tiny(seed: int = 0, **updates) -> K3ForCausalLM:
    """The k3-tiny model with random AttnRes pseudo-queries and QB bias (zeros would hide bugs)."""
    torch.manual_seed(seed)
    config = K3Config.preset("k3-tiny")
    if updates:
        config = config.model_copy(update=updates)
        config = K3Config.model_validate(config.model_dump())
    model = K3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5)
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    return model.eval()

