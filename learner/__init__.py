"""k3rl.learner: Per-Head Muon (`optim`), RL and SFT objectives (`losses`), packing (`data`), the
`Trainer` (`trainer`), trainer checkpoints (`checkpoint`), FSDP2 data parallelism (`distributed`) and
the learner actor (`actor`). The model itself is `k3rl.model`.

The names below are imported on first use, so importing one submodule does not pull in the trainer.
"""

from __future__ import annotations

from k3rl.lazy import lazy_getattr

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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
