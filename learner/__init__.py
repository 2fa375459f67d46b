"""k3rl.learner: Per-Head Muon (`optim`), RL and SFT objectives (`losses`), packing (`data`), the
`Trainer` (`trainer`), trainer checkpoints (`checkpoint`), FSDP2 data parallelism (`distributed`) and
the learner actor (`actor`). The model itself is `k3rl.model`.

The names below are imported on first use, so importing one submodule does not pull in the trainer.
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
