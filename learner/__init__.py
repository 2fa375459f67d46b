"""k3rl.learner: the K3 model (`k3rl.learner.model`), Per-Head Muon (`optim`), RL and SFT
objectives (`losses`), packing (`data`), the `Trainer` (`trainer`), trainer checkpoints
(`checkpoint`) and FSDP2 data parallelism (`distributed`).

The names below are imported on first use, so `import k3rl.learner.model` (the rollout
engine's import) does not pull in the trainer.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PerHeadMuon": "optim",
    "param_groups": "optim",
    "newton_schulz": "optim",
    "LossConfig": "losses",
    "group_advantages": "losses",
    "policy_loss": "losses",
    "sft_loss": "losses",
    "Trainer": "trainer",
    "lr_at": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
