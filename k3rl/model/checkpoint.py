"""Checkpoints in the release's Hugging Face layout (docs/model.md §12).

A directory holds `config.json` (K3Config.to_hf, with the quantization section under
`text_config` when the experts are MXFP4), `model-0000i-of-0000n.safetensors` shards and
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {name: file}}), under
the release's names (`state_dict_adapter`).

    save_hf(model, dir, experts="dense")   experts as the model holds them: save -> load is bit-exact
    save_hf(model, dir, experts="mxfp4")   experts as the release stores them (MXFP4, 32 per scale)
    load_state_into(model, dir)            the release, or anything save_hf wrote

Loading streams: every name, shape and dtype is checked against the model from the shard headers
alone, before any value is read; then the tensors are read one at a time, shard after shard, each
MXFP4 expert dequantised to the model's dtype as it is read and copied into its row of the stacked
expert weight. Beside the model, memory holds one tensor (one expert) at a time, never the checkpoint.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import mxfp4
from . import state_dict_adapter as adapter
from .model import K3ForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: lists missing / unexpected / mis-shaped names."""


# ----- saving ---------------------------------------------------------------------------------


def _our_state(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_hf(model: K3ForCausalLM, directory: str | Path, max_shard_bytes: int = 5 * 2**30,
            experts: adapter.ExpertFormat | None = None) -> Path:
    """Write config.json, safetensors shards of at most `max_shard_bytes` (one tensor may exceed it
    alone) in the model's order (layer by layer) and the index. Returns the directory.

    experts  "dense": the routed experts as the model holds them (bit-exact round trip);
             "mxfp4": quantised as the release stores them, with the quantization section;
             None: as the model's weights came (`model.routed_experts_format`, set by `build_model`
             when it loads a checkpoint), else dense.
    """
    experts = experts or getattr(model, "routed_experts_format", "dense")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.to_hf(out, quantization_config=mxfp4.quantization_config() if experts == "mxfp4" else None)
    state = _our_state(model)
    weight_map = assign_shards(adapter.hf_layout(state, experts), max_shard_bytes)
    shards: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        shards.setdefault(fname, []).append(name)
    tensors = adapter.iter_hf(state, experts)
    total = 0
    for fname, names in shards.items():
        shard = {}
        for name in names:
            got, t = next(tensors)
            assert got == name, (got, name)  # hf_layout and iter_hf walk the state in the same order
            shard[name] = t.detach().to("cpu").contiguous().clone()
            total += t.numel() * t.element_size()
        save_file(shard, str(out / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def assign_shards(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> dict[str, str]:
    """{name: shard file}: the names in `layout`'s order cut into shards of at most `max_shard_bytes`."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in layout.items():
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return {name: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, names in enumerate(shards) for name in names}


# ----- what a checkpoint holds (headers only) ----------------------------------------------------


@dataclass(frozen=True, slots=True)  # slots: the release has 497,220 of them
class StoredTensor:
    """One tensor of a checkpoint, from its shard's header: no value is read."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def read_index(directory: str | Path) -> dict[str, str]:
    """{name: shard file} from the index, or every name of a single model.safetensors."""
    d = Path(directory)
    if (d / INDEX_NAME).exists():
        return json.loads((d / INDEX_NAME).read_text())["weight_map"]
    if (d / SINGLE_NAME).exists():
        return {name: SINGLE_NAME for name in read_header(d / SINGLE_NAME)}
    raise FileNotFoundError(f"{d}: no {INDEX_NAME} or {SINGLE_NAME}; is this a Hugging Face checkpoint directory?")


def read_header(path: str | Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header (8-byte length, then JSON)."""
    path = Path(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    out, fname = {}, path.name
    for name, h in header.items():
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {h['dtype']}, which k3rl does not read")
        start, end = h["data_offsets"]
        out[name] = StoredTensor(fname, DTYPES[h["dtype"]], tuple(h["shape"]), end - start)
    return out


def stored_tensors(directory: str | Path) -> dict[str, StoredTensor]:
    """Every tensor a checkpoint directory holds (index + shard headers), without reading values."""
    d = Path(directory)
    weight_map = read_index(d)
    out: dict[str, StoredTensor] = {}
    for fname in sorted(set(weight_map.values())):
        if not (d / fname).exists():
            raise FileNotFoundError(f"{d}: the index names shard {fname}, which is missing")
        for name, t in read_header(d / fname).items():
            if weight_map.get(name) == fname:
                out[name] = t
    absent = sorted(set(weight_map) - set(out))
    if absent:
        raise FileNotFoundError(f"{d}: the index names {len(absent)} tensors its shards lack, e.g. {absent[:3]}")
    return out


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read into memory (for small checkpoints and tests;
    loading a model streams instead: `load_state_into`)."""
    d = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, t in stored_tensors(d).items():
        by_file.setdefault(t.file, []).append(name)
    for fname, names in sorted(by_file.items()):
        with safe_open(str(d / fname), framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors


def checkpoint_quantization(directory: str | Path) -> dict | None:
    """The quantization section of a checkpoint's config.json (under text_config, as the release
    has it, or at the top level); refuses formats k3rl cannot read. None when unquantised."""
    path = Path(directory) / "config.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    section = (raw.get("text_config") or {}).get("quantization_config") or raw.get("quantization_config")
    mxfp4.check_quantization_config(section, str(path))
    return section


# ----- matching a checkpoint to a model ------------------------------------------------------------


def match_checkpoint(stored: dict[str, StoredTensor], expected: dict[str, torch.Tensor],
                     where: str = "checkpoint") -> dict[str, adapter.Target]:
    """Where each stored tensor goes in `expected` (our state dict; `meta` tensors are enough).
    Raises CheckpointMismatchError naming every missing, unexpected and mis-shaped tensor."""
    targets: dict[str, adapter.Target] = {}
    unexpected, bad = [], []
    seen: dict[tuple, str] = {}
    for name, s in stored.items():
        t = adapter.resolve(name)
        if t is None or t.key not in expected or (t.expert is not None and t.expert >= expected[t.key].shape[0]):
            unexpected.append(name)
            continue
        if (t.key, t.expert, t.part) in seen:
            bad.append(f"{name}: the same tensor as {seen[t.key, t.expert, t.part]}")
            continue
        seen[t.key, t.expert, t.part] = name
        want = _stored_shape(t, expected[t.key])
        if s.shape not in want:
            bad.append(f"{name}: checkpoint {s.shape} vs model {want[0]}")
        elif t.part != "weight" and s.dtype != torch.uint8:
            bad.append(f"{name}: stored as {str(s.dtype).removeprefix('torch.')}, an MXFP4 {t.part} is uint8")
        targets[name] = t
    mxfp4_stored = any(t.part != "weight" for t in targets.values())
    missing = []
    for key, value in expected.items():
        if not adapter.is_stacked_experts(key):
            if (key, None, "weight") not in seen:
                missing.append(adapter.hf_name(key))
            continue
        for e in range(value.shape[0]):
            parts = {p for p in ("weight", "weight_packed", "weight_scale") if (key, e, p) in seen}
            if parts in ({"weight"}, {"weight_packed", "weight_scale"}):
                continue
            if "weight" in parts:
                bad.append(f"{adapter.expert_names(key, e, 'dense')[0]}: stored both as .weight and as MXFP4")
                continue
            fmt = "mxfp4" if parts or mxfp4_stored else "dense"
            missing += [n for n in adapter.expert_names(key, e, fmt) if n.rsplit(".", 1)[1] not in parts]
    if missing or unexpected or bad:
        lines = [f"{where} does not match the model:"]
        for title, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", bad)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        raise CheckpointMismatchError("\n".join(lines))
    return targets


def _stored_shape(t: adapter.Target, value: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The shapes the checkpoint may store for target `t` (the first is the release's)."""
    if t.expert is None:
        if t.key.endswith(".self_attn.A_log"):  # padded to 128 in the release
            return (adapter.padded_a_log_size(value.shape[0]),), tuple(value.shape)
        return (tuple(value.shape),)
    row = tuple(value.shape[1:])
    if t.part == "weight":
        return (row,)
    packed, scale = mxfp4.packed_shapes(row)
    return (packed if t.part == "weight_packed" else scale,)


# ----- loading ------------------------------------------------------------------------------------------


def load_state_into(model: K3ForCausalLM | dict[str, torch.Tensor], directory: str | Path) -> adapter.ExpertFormat:
    """Load a checkpoint into `model` (or into a state dict of our names), streaming (module
    docstring). Returns how its routed experts were stored: "mxfp4" or "dense".

    Raises CheckpointMismatchError naming every missing, unexpected and mis-shaped tensor, before
    any value is copied.
    """
    d = Path(directory)
    if isinstance(model, dict):
        dest = model
    else:
        keys = set(_our_state(model))
        dest = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if n in keys}
    stored = stored_tensors(d)
    checkpoint_quantization(d)
    targets = match_checkpoint(stored, dest, where=f"checkpoint {directory}")
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(stored[name].file, []).append(name)
    with torch.no_grad():
        for fname, names in sorted(by_file.items()):
            with safe_open(str(d / fname), framework="pt") as f:
                for name in names:
                    t = targets[name]
                    if t.part == "weight_scale":
                        continue  # read with its weight_packed
                    value = f.get_tensor(name)
                    if t.part == "weight_packed":
                        scale_name = name.removesuffix("_packed") + "_scale"
                        scale = _read(d, stored[scale_name].file, scale_name, f if stored[scale_name].file == fname else None)
                        value = mxfp4.dequantize(value, scale, dest[t.key].dtype)
                    if t.expert is not None:
                        dest[t.key][t.expert].copy_(value)
                    elif t.key.endswith(".self_attn.A_log"):
                        dest[t.key].copy_(adapter.a_log_value(value, dest[t.key].shape[0]))
                    else:
                        dest[t.key].copy_(value)
    return "mxfp4" if any(t.part != "weight" for t in targets.values()) else "dense"


def _read(d: Path, fname: str, name: str, open_file=None) -> torch.Tensor:
    if open_file is not None:
        return open_file.get_tensor(name)
    with safe_open(str(d / fname), framework="pt") as f:
        return f.get_tensor(name)
