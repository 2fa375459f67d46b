"""Our module names <-> the official Kimi-K3 Hugging Face weight names, in one place.

Our modules already carry the official names (`model.layers.{i}.self_attn.q_proj.weight`,
`model.layers.{i}.mlp.gate.e_score_correction_bias`, `model.embed_tokens.weight`,
`lm_head.weight`, `vision_tower.*`, `mm_projector.proj.{0,2}.weight`, ...). Two tensors differ:

- routed experts are stored stacked, `mlp.experts.w1` [E, f, l]; the checkpoint has one
  tensor per expert, `mlp.experts.{e}.w1.weight` [f, l] (same for w3; w2 is [l, f]);
- KDA `A_log` is [H] in the model; the checkpoint stores it zero-padded to a multiple of 128
  (docs/model.md §2.1: [96] used, [128] stored), and loading takes the first H entries.
"""

from __future__ import annotations

import re

import torch

A_LOG_PAD = 128
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(w[123])$")
_EXPERT_HF = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_A_LOG = re.compile(r"^model\.layers\.\d+\.self_attn\.A_log$")


def padded_a_log_size(num_heads: int) -> int:
    return -(-num_heads // A_LOG_PAD) * A_LOG_PAD


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> official names and shapes (experts split, A_log padded)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _EXPERTS.match(name)
        if m:
            prefix, w = m.groups()
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{w}.weight"] = t[e]
        elif _A_LOG.match(name):
            padded = t.new_zeros(padded_a_log_size(t.shape[0]))
            padded[: t.shape[0]] = t
            out[name] = padded
        else:
            out[name] = t
    return out


def from_hf(
    hf: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], fill_missing_experts: bool = True
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Official tensors -> our names, guided by the model's own state dict `expected` (for
    shapes). Returns (state dict, names in `hf` that map to nothing in the model).

    When only some experts of a layer are given (a partial weight update), the stacked tensor
    takes the others from `expected` (the model's current values) if `fill_missing_experts`,
    and is left out otherwise (a checkpoint loader then reports those experts as missing).
    """
    out: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        m = _EXPERT_HF.match(name)
        if m:
            prefix, e, w = m.groups()
            key = f"{prefix}.{w}"
            if key not in expected:
                unexpected.append(name)
                continue
            experts.setdefault((prefix, w), {})[int(e)] = t
        elif _A_LOG.match(name) and name in expected:
            h = expected[name].shape[0]
            if t.dim() == 1 and t.shape[0] >= h:
                out[name] = t[:h].clone()
            else:
                out[name] = t  # the shape check reports it
        elif name in expected:
            out[name] = t
        else:
            unexpected.append(name)
    for (prefix, w), per_expert in experts.items():
        key = f"{prefix}.{w}"
        current = expected[key]
        n = current.shape[0]
        extra = sorted(set(per_expert) - set(range(n)))
        unexpected.extend(f"{prefix}.{e}.{w}.weight" for e in extra)
        missing = [e for e in range(n) if e not in per_expert]
        if not missing:
            out[key] = torch.stack([per_expert[e] for e in range(n)])
        elif fill_missing_experts:
            out[key] = torch.stack([
                per_expert[e].to(device=current.device, dtype=current.dtype) if e in per_expert else current[e]
                for e in range(n)
            ])
        # else: left out, so the caller reports the missing experts by name
    return out, unexpected


def missing_hf_names(key: str, expected: torch.Tensor, hf_names: set[str]) -> list[str]:
    """The official names behind one of our tensors that are absent from `hf_names`."""
    m = _EXPERTS.match(key)
    if m:
        prefix, w = m.groups()
        return [f"{prefix}.{e}.{w}.weight" for e in range(expected.shape[0]) if f"{prefix}.{e}.{w}.weight" not in hf_names]
    return [key] if key not in hf_names else []
