"""The weights the engine's forwards read, and their version: a weight update is validated whole, then
copied into the model's parameters in place (so every captured CUDA graph, which reads the parameters
where they lie, sees it); an adapters-only update (LoRA) is merged into a kept copy of the base weights."""

from __future__ import annotations

import torch

from k3rl.model.lora import is_adapter_update, lora_targets, merge_adapters
from k3rl.model.moe import RoutedExperts
from k3rl.model.state_dict_adapter import from_hf, to_hf
from k3rl.types import WeightUpdate


class VersionedWeights:
    """The model's weights and their version. `apply` runs between two scheduler steps only (the
    engine calls it there), so the switch is atomic: a step reads one version throughout."""

    def __init__(self, model, version: int = 0):
        self.model = model
        self.version = version
        self.lora_base: dict[str, torch.Tensor] | None = None  # unmerged weights under LoRA adapters syncs

    def apply(self, update: WeightUpdate) -> int:
        """Copy `update` into the model after checking all of it (names, shapes, completeness); returns the
        new version. A bad update raises and leaves the weights as they were."""
        if update.version <= self.version:
            raise ValueError(f"weight update v{update.version} is not newer than the engine's v{self.version}; "
                             "versions must increase")
        merged = self._merge_lora_adapters(update)
        new_base, update = merged is update and update.full, merged
        held = held_experts(self.model)
        # experts held as MXFP4 bytes are matched as their dense weights: their values when a partial
        # update may leave some of them as they are, else only their shape and dtype
        expected = {**self.model.state_dict(),
                    **{key: m.dense_weight(w, values=not update.full) for key, (m, w) in held.items()}}
        # a partial update may carry some experts of a layer (the others keep their values); a
        # full one must carry all of them, so nothing is filled in and the gaps are reported.
        # Experts come as `.weight` or as MXFP4 `.weight_packed` + `.weight_scale` (dequantised here)
        state, unexpected = from_hf(update.state_dict(), expected, fill_missing_experts=not update.full)
        if unexpected:
            raise ValueError(f"weight update v{update.version} has {len(unexpected)} names the model does not have, "
                             f"e.g. {unexpected[:3]}; send official HF names (state_dict_adapter.to_hf)")
        for name, t in state.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(f"weight update v{update.version}: {name} has shape {tuple(t.shape)}, the model "
                                 f"expects {tuple(expected[name].shape)}")
        if update.full:
            missing = sorted(set(expected) - set(state) - {f"{k}_{part}" for k in held for part in ("packed", "scale")})
            if missing:
                raise ValueError(f"weight update v{update.version} is marked full but lacks {len(missing)} tensors, "
                                 f"e.g. {missing[:3]}; send them or set full=False")
        # validated: now copy everything (nothing runs in between, so the switch is atomic)
        for name, t in state.items():
            if name in held:
                module, w = held[name]
                module.store_(w, t.to(module.held_dtype))  # MXFP4 values come back to the same values
            else:
                expected[name].copy_(t.to(device=expected[name].device, dtype=expected[name].dtype))
        self.version = update.version
        if new_base:
            self.lora_base = None  # whole new weights: later LoRA adapters are merged into these
        return self.version

    def _merge_lora_adapters(self, update: WeightUpdate) -> WeightUpdate:
        """An adapters-only update (learner.lora.sync: adapters) as the weights it stands for,
        W + (alpha / r) B A, with W the engine's weights from before the first adapters update
        (kept aside then: each version is merged into the base, never into merged weights).
        Any other update is returned as it is."""
        adapters = update.state_dict()
        if not is_adapter_update(adapters):
            return update
        if self.lora_base is None:
            dense = {key: m.dense_weight(w) for key, (m, w) in held_experts(self.model).items()}
            weights = to_hf({**self.model.state_dict(), **dense}, experts="dense")
            self.lora_base = {n: weights[n].clone() for n in lora_targets(adapters) if n in weights}
        merged = merge_adapters(self.lora_base, adapters)
        return WeightUpdate.from_state_dict(update.version, merged, full=False, transport=update.transport)


def held_experts(model) -> dict[str, tuple[RoutedExperts, str]]:
    """{the stacked key of a dense expert weight (`model.layers.1.mlp.experts.w1`): (its module, "w1")} for
    every expert matrix the model holds as MXFP4 bytes (`RoutedExperts.hold_mxfp4_`)."""
    return {f"{prefix}.{w}": (m, w) for prefix, m in model.named_modules()
            if isinstance(m, RoutedExperts) and m.held_dtype is not None for w in m.NAMES}
