"""Checkpoints in the official Kimi-K3 Hugging Face layout.

A directory holds `config.json` (K3Config.to_hf), `model-0000i-of-0000n.safetensors` shards
and `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {name: file}}),
with the official weight names (`state_dict_adapter`). Tensors keep their dtypes, so
save -> load is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import state_dict_adapter as adapter
from .config import K3Config
from .model import K3ForCausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: lists missing / unexpected / mis-shaped names."""


def _hf_state(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return adapter.to_hf(state)


def save_hf(model: K3ForCausalLM, directory: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json, safetensors shards of at most `max_shard_bytes` (one tensor may exceed
    it alone) and the index. Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.to_hf(out)
    state = _hf_state(model)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: state[n].detach().to("cpu").contiguous().clone() for n in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (sharded with an index, or one model.safetensors)."""
    d = Path(directory)
    if (d / INDEX_NAME).exists():
        weight_map = json.loads((d / INDEX_NAME).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (d / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        raise FileNotFoundError(f"{d}: no {INDEX_NAME} or {SINGLE_NAME}; is this a Hugging Face checkpoint directory?")
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        if not (d / fname).exists():
            raise FileNotFoundError(f"{d}: the index names shard {fname}, which is missing")
        with safe_open(str(d / fname), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_state_into(model: K3ForCausalLM, directory: str | Path) -> None:
    """Load a checkpoint into `model` (values are copied into the model's parameters).

    Raises CheckpointMismatchError naming every missing, unexpected and mis-shaped tensor.
    """
    hf = read_hf_tensors(directory)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    ours, unexpected = adapter.from_hf(hf, expected, fill_missing_experts=False)
    hf_names = set(hf)
    missing = [n for key in expected if key not in ours for n in adapter.missing_hf_names(key, expected[key], hf_names)]
    mis_shaped = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in ours.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mis_shaped:
        lines = [f"checkpoint {directory} does not match the model:"]
        for title, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", mis_shaped)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        raise CheckpointMismatchError("\n".join(lines))
    with torch.no_grad():
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        for name, value in ours.items():
            params[name].copy_(value)


def load_hf(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> K3ForCausalLM:
    """Build a model from `config.json` (`build_model`) and load its weights. The parameter dtype
    is `dtype` (the fp32 allow-list excepted) or, by default, the checkpoint's embedding dtype."""
    from .factory import build_model

    config = K3Config.from_hf(directory)
    if dtype is None:
        d = Path(directory)
        if (d / INDEX_NAME).exists():
            shard = json.loads((d / INDEX_NAME).read_text())["weight_map"]["model.embed_tokens.weight"]
        else:
            shard = SINGLE_NAME
        with safe_open(str(d / shard), framework="pt") as f:
            dtype = f.get_slice("model.embed_tokens.weight").get_dtype()
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}[dtype]
    return build_model(config, dtype=dtype, device=device, checkpoint=directory)
