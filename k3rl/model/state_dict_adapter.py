"""Our state-dict names <-> the release's tensor names (docs/model.md §12), in one place.

    ours                                        release
    model.*, lm_head.weight                     language_model.model.*, language_model.lm_head.weight
    model.layers.{i}.mlp.*  (MoE layers)        language_model.model.layers.{i}.block_sparse_moe.*
    model.layers.{i}.mlp.*  (dense layer 0)     language_model.model.layers.{i}.mlp.*
    ....mlp.experts.w1 [E, f, l] (stacked)      ....block_sparse_moe.experts.{e}.w1.weight_packed + .weight_scale
                                                (MXFP4, `experts="mxfp4"`) or .weight [f, l] (`experts="dense"`)
    ....self_attn.A_log [H]                     the same name, zero-padded to a multiple of 128 (§2.1)
    vision_tower.*, mm_projector.*              unchanged

w1 is the experts' gate, w3 their up and w2 their down projection (w2 is [E, l, f]). Every other
name (KDA, MLA, AttnRes, norms, the tower) is the same on both sides.

Reading also accepts the names k3rl wrote before it used the release's (no `language_model.`
prefix, `mlp.` for MoE layers, experts as `.weight`), so older checkpoints and updates still load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from . import mxfp4

A_LOG_PAD = 128
PREFIX = "language_model."
UNPREFIXED = ("vision_tower.", "mm_projector.")
ExpertFormat = Literal["dense", "mxfp4"]
EXPERT_PARTS = {"dense": ("weight",), "mxfp4": ("weight_packed", "weight_scale")}

_MOE = re.compile(r"^(model\.layers\.\d+\.)mlp\.((?:gate|experts|shared_experts)(?:\.|$)|routed_expert_)")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(w[123])$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_A_LOG = re.compile(r"^model\.layers\.\d+\.self_attn\.A_log$")


def padded_a_log_size(num_heads: int) -> int:
    return -(-num_heads // A_LOG_PAD) * A_LOG_PAD


def is_stacked_experts(key: str) -> bool:
    """True for our stacked expert weights (`model.layers.{i}.mlp.experts.w1|w2|w3`)."""
    return _STACKED.match(key) is not None


def hf_name(key: str) -> str:
    """The release's name of one of our (non-stacked) state-dict keys."""
    if key.startswith(UNPREFIXED):
        return key
    return PREFIX + _MOE.sub(r"\1block_sparse_moe.\2", key)


def expert_names(key: str, e: int, experts: ExpertFormat) -> list[str]:
    """The release's names of expert `e` of a stacked key (`...mlp.experts.w1`)."""
    prefix, w = _STACKED.match(key).groups()
    return [f"{hf_name(prefix)}.{e}.{w}.{part}" for part in EXPERT_PARTS[experts]]


@dataclass(frozen=True, slots=True)
class Target:
    """Where one of the release's tensors goes: our key, the expert row of a stacked key, the part."""

    key: str
    expert: int | None = None
    part: str = "weight"  # "weight", or "weight_packed" / "weight_scale" of an MXFP4 expert


def resolve(name: str) -> Target | None:
    """The Target of a release name (or of the previous k3rl name); None when it cannot be ours."""
    m = _EXPERT.match(name)
    if m:
        prefix, e, w, part = m.groups()
        key = _our_key(prefix)
        return None if key is None else Target(f"{key}.{w}", int(e), part)
    key = _our_key(name)
    return None if key is None else Target(key)


@lru_cache(maxsize=4096)  # an expert's prefix repeats for its 896 experts x 3 matrices x 2 parts
def _our_key(name: str) -> str | None:
    if name.startswith(UNPREFIXED):
        return name
    if name.startswith(PREFIX):
        key = name[len(PREFIX):].replace(".block_sparse_moe.", ".mlp.", 1)
        return key if hf_name(key) == name else None  # e.g. `mlp.` for a MoE layer is not the release's name
    return name if name.startswith(("model.", "lm_head.")) else None  # k3rl's previous names


def hf_layout(state: dict[str, torch.Tensor], experts: ExpertFormat = "dense") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{release name: (shape, dtype)} of what `to_hf(state, experts)` writes, from shapes alone
    (works on the `meta` device: the full preset lists its 497,220 names without any memory)."""
    if experts not in EXPERT_PARTS:
        raise ValueError(f"experts must be one of {sorted(EXPERT_PARTS)}, got {experts!r}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, t in state.items():
        if is_stacked_experts(key):
            row = tuple(t.shape[1:])
            shapes = (row,) if experts == "dense" else mxfp4.packed_shapes(row)
            dtype = t.dtype if experts == "dense" else torch.uint8
            for e in range(t.shape[0]):
                for name, shape in zip(expert_names(key, e, experts), shapes, strict=True):
                    out[name] = (shape, dtype)
        elif _A_LOG.match(key):
            out[hf_name(key)] = ((padded_a_log_size(t.shape[0]),), t.dtype)
        else:
            out[hf_name(key)] = (tuple(t.shape), t.dtype)
    return out


def iter_hf(state: dict[str, torch.Tensor], experts: ExpertFormat = "dense"):
    """(release name, tensor) in the model's order, one of our tensors at a time (what `to_hf`
    collects; `save_hf` writes shards from it without holding a second copy of the model)."""
    if experts not in EXPERT_PARTS:
        raise ValueError(f"experts must be one of {sorted(EXPERT_PARTS)}, got {experts!r}")
    for key, t in state.items():
        if is_stacked_experts(key):
            parts = (t,) if experts == "dense" else mxfp4.quantize(t.detach())  # all experts of the key at once
            for e in range(t.shape[0]):
                for name, p in zip(expert_names(key, e, experts), parts, strict=True):
                    yield name, p[e]
        elif _A_LOG.match(key):
            padded = t.new_zeros(padded_a_log_size(t.shape[0]))
            padded[: t.shape[0]] = t
            yield hf_name(key), padded
        else:
            yield hf_name(key), t


def to_hf(state: dict[str, torch.Tensor], experts: ExpertFormat = "dense") -> dict[str, torch.Tensor]:
    """Our state dict -> the release's names and shapes: experts split one tensor per expert
    (MXFP4-quantised with `experts="mxfp4"`, else as they are), A_log padded."""
    return dict(iter_hf(state, experts))


def a_log_value(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The model's A_log [H] from the stored (padded) one; other shapes pass through for the shape check."""
    return t[:heads] if t.dim() == 1 and t.shape[0] >= heads else t


def expert_value(pieces: dict[str, torch.Tensor], name: str, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight from its release tensors: `.weight` as it is, or MXFP4 packed + scale
    dequantised to `dtype`. `name` (any of the expert's names) is only for the error message."""
    if set(pieces) == {"weight"}:
        return pieces["weight"]
    if set(pieces) != {"weight_packed", "weight_scale"}:
        raise ValueError(f"{name}: an expert is either .weight or MXFP4 .weight_packed + .weight_scale, "
                         f"got {sorted(pieces)}")
    packed, scale = pieces["weight_packed"], pieces["weight_scale"]
    want = mxfp4.packed_shapes(row_shape)
    if (tuple(packed.shape), tuple(scale.shape)) != want:
        raise ValueError(f"{name}: MXFP4 weight_packed {tuple(packed.shape)} / weight_scale {tuple(scale.shape)}, the "
                         f"model's [{', '.join(map(str, row_shape))}] expert needs {want[0]} / {want[1]}")
    return mxfp4.dequantize(packed, scale, dtype)


def from_hf(
    hf: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], fill_missing_experts: bool = True
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The release's tensors -> our names, guided by the model's own state dict `expected` (for
    shapes and dtypes). MXFP4 experts are dequantised to the expected dtype. Returns (state
    dict, names in `hf` that map to nothing in the model).

    When only some experts of a layer are given (a partial weight update), the stacked tensor
    takes the others from `expected` (the model's current values) if `fill_missing_experts`,
    and is left out otherwise (a checkpoint loader then reports those experts as missing).
    """
    out: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    first_name: dict[tuple[str, int], str] = {}
    for name, t in hf.items():
        target = resolve(name)
        if target is None or target.key not in expected:
            unexpected.append(name)
        elif target.expert is not None:
            if target.expert >= expected[target.key].shape[0]:
                unexpected.append(name)
                continue
            pieces = experts.setdefault(target.key, {}).setdefault(target.expert, {})
            if target.part in pieces:
                raise ValueError(f"{name}: expert {target.expert} of {target.key} appears twice under two names")
            pieces[target.part] = t
            first_name.setdefault((target.key, target.expert), name)
        elif target.key in out:
            raise ValueError(f"{name}: the same tensor appears twice under two names ({target.key})")
        elif _A_LOG.match(target.key):
            out[target.key] = a_log_value(t, expected[target.key].shape[0])
        else:
            out[target.key] = t
    for key, per_expert in experts.items():
        current = expected[key]
        rows = {e: expert_value(p, first_name[(key, e)], tuple(current.shape[1:]), current.dtype)
                for e, p in per_expert.items()}
        n = current.shape[0]
        if len(rows) == n:
            out[key] = torch.stack([rows[e] for e in range(n)])
        elif fill_missing_experts:
            out[key] = torch.stack([
                rows[e].to(device=current.device, dtype=current.dtype) if e in rows else current[e] for e in range(n)
            ])
        # else: left out, so the caller reports the missing experts by name
    return out, unexpected
