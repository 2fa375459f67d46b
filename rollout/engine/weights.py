"""The weights the engine's forwards read, and their version: a weight update is validated whole, then
copied into the model's parameters in place (so every captured CUDA graph, which reads the parameters
where they lie, sees it); an adapters-only update (LoRA) is merged into a kept copy of the base weights."""

from __future__ import annotations

import torch

from k3rl.model.lora import is_adapter_update, lora_targets, merge_adapters
from k3rl.model.moe import RoutedExperts
from k3rl.model.state_dict_adapter import from_hf, resolve, to_hf
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
        # MXFP4 experts into experts held as MXFP4 bytes: copied as they come; any other update of those is
        # matched as their dense weights (their values when a partial update keeps some, else shape and dtype)
        hf, byte_rows, filled = _held_bytes(update.state_dict(), held, update.version, update.full)
        expected = {**self.model.state_dict(), **{key: m.dense_weight(w, values=not update.full)
                                                  for key, (m, w) in held.items() if key not in filled}}
        # a partial update may carry some experts of a layer (the others keep their values); a
        # full one must carry all of them, so nothing is filled in and the gaps are reported.
        # Experts come as `.weight` or as MXFP4 `.weight_packed` + `.weight_scale` (dequantised here)
        state, unexpected = from_hf(hf, expected, fill_missing_experts=not update.full)
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
        for row, t in byte_rows:
            row.copy_(t)
        for name, t in state.items():
            if name in held:
                module, w = held[name]
                module.store_(w, t)  # quantised as it came (MXFP4 values come back to themselves)
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


def _held_bytes(hf: dict[str, torch.Tensor], held: dict, version: int, full: bool):
    """Split off the update's MXFP4 pieces (`weight_packed`, `weight_scale`) of expert matrices the engine
    holds as MXFP4 bytes, checked: (the rest of the update, [(buffer row, bytes to copy into it)], the held
    keys they fill). Every expert they name must come whole, and under a full update every expert."""
    rest, rows, got = {}, [], {}
    for name, t in hf.items():
        target = resolve(name)
        if target is None or target.key not in held or target.part == "weight":
            rest[name] = t
            continue
        module, w = held[target.key]
        buf = getattr(module, f"{w}_{target.part.removeprefix('weight_')}")
        if target.expert >= buf.shape[0] or tuple(t.shape) != tuple(buf.shape[1:]) or t.dtype != torch.uint8:
            raise ValueError(f"weight update v{version}: {name} is {t.dtype} {tuple(t.shape)}; the engine holds "
                             f"{target.part} as uint8 {tuple(buf.shape[1:])} for each of {buf.shape[0]} experts")
        rows.append((buf[target.expert], t))
        got.setdefault(target.key, set()).add((target.expert, target.part))
    for key, parts in got.items():
        experts = range(held[key][0].w1_packed.shape[0]) if full else {e for e, _ in parts}
        lacking = sorted({(e, p) for e in experts for p in ("weight_packed", "weight_scale")} - parts)
        if lacking:
            raise ValueError(f"weight update v{version} lacks {len(lacking)} MXFP4 pieces of {key}, e.g. "
                             f"(expert, part) {lacking[:3]}; send weight_packed and weight_scale of "
                             f"{'every expert' if full else 'each expert it carries'}")
    return rest, rows, set(got)


def held_experts(model) -> dict[str, tuple[RoutedExperts, str]]:
    """{the stacked key of a dense expert weight (`model.layers.1.mlp.experts.w1`): (its module, "w1")} for
    every expert matrix the model holds as MXFP4 bytes (`RoutedExperts.hold_mxfp4_`)."""
    return {f"{prefix}.{w}": (m, w) for prefix, m in model.named_modules()
            if isinstance(m, RoutedExperts) and m.held_dtype is not None for w in m.NAMES}
