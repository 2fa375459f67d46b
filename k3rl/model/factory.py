"""One way to build a K3 model: (preset or config, overrides, dtype, device) -> K3ForCausalLM.

The learner (`Trainer.from_job`), the embedded engine (`EmbeddedEngine.from_preset`) and
checkpoint loading (`load_hf`) all build their model here, so the policy that is trained and
the policy that samples are the same architecture with the same seeded initialisation.

    model = build_model("k3-tiny", {"num_hidden_layers": 8}, dtype="bfloat16", seed=0)
    model = build_model("k3", device="meta")              # the full model, no memory allocated
    model = build_model(config, checkpoint="ckpt/model")  # weights from an HF-layout directory
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import state_dict_adapter as adapter
from .checkpoint import CheckpointMismatchError, load_state_into, stored_tensors
from .config import K3Config, model_config  # noqa: F401  (model_config: k3rl.model.factory.model_config, as before)
from .model import K3ForCausalLM


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16 (torch dtypes pass through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown parameter dtype {dtype!r}; use 'float32' or 'bfloat16'")
    return value


def build_model(preset_or_config: str | K3Config, overrides: dict[str, Any] | None = None, *,
                dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu", seed: int | None = None,
                checkpoint: str | Path | None = None) -> K3ForCausalLM:
    """Build a K3ForCausalLM.

    preset_or_config  "k3" / "k3-small" / "k3-tiny", or a K3Config
    overrides         K3Config fields replacing the preset's
    dtype             parameter dtype; the fp32 allow-list (KDA gate parameters, convolutions,
                      the QB bias) stays fp32 whatever it is
    device            "meta" builds without allocating (the full `k3` preset fits anywhere);
                      any other device gets weights initialised on the CPU and then moved, so a
                      seed gives the same weights on every device
    seed              seeds torch before the initialisation (None: the current RNG state)
    checkpoint        an HF-layout directory (the release, or what `save_hf` wrote) whose weights
                      are loaded into the model, MXFP4 experts dequantised to `dtype`; its config.json
                      must describe the same architecture as the preset and overrides, and a tensor
                      missing, unexpected or of another shape raises CheckpointMismatchError

    A model loaded from a checkpoint remembers how its routed experts were stored there,
    `model.routed_experts_format` ("mxfp4" for the release, else "dense"): `save_hf` writes them
    back that way by default, and the learner's weight sync sends them that way (what the engines
    started from the same checkpoint hold).
    """
    config = model_config(preset_or_config, overrides)
    dtype, device = as_dtype(dtype), torch.device(device)
    if checkpoint is not None and device.type == "meta":
        raise ValueError("a model on the meta device holds no values: load the checkpoint on a real device")
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device("meta" if device.type == "meta" else "cpu"):
        model = K3ForCausalLM(config)
    if dtype != torch.float32:
        model.to_param_dtype(dtype)
    if checkpoint is not None:
        differ = architecture_differences(config, checkpoint)
        hint = (f"its config.json describes another architecture than the model being built: {differ}; choose the "
                f"preset (and overrides) that match it, e.g. model.preset: k3 for the release")
        try:
            model.routed_experts_format = load_state_into(model, checkpoint)
        except CheckpointMismatchError as e:
            raise CheckpointMismatchError(f"{e}\n  {hint}" if differ else str(e)) from None
        if differ:  # same shapes, other constants (norm eps, SiTU betas, ...): it would compute something else
            raise ValueError(f"checkpoint {checkpoint}: {hint}")
    return model.to(device)


def load_hf(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> K3ForCausalLM:
    """Build a model from `config.json` (`build_model`) and load its weights. The parameter dtype
    is `dtype` (the fp32 allow-list excepted) or, by default, the checkpoint's embedding dtype."""
    config = K3Config.from_hf(directory)
    if dtype is None:
        embed = [t for n, t in stored_tensors(directory).items()
                 if adapter.resolve(n) == adapter.Target("model.embed_tokens.weight")]
        if not embed:
            raise CheckpointMismatchError(f"checkpoint {directory} has no token embedding "
                                          f"({adapter.hf_name('model.embed_tokens.weight')})")
        dtype = embed[0].dtype
    return build_model(config, dtype=dtype, device=device, checkpoint=directory)


# K3Config fields that do not change the weights or what they compute, or that are the run's choice
# (expert_precision: the same weights, read in MXFP4 or not): the preset's values are kept whatever the
# checkpoint's config.json says (the release's has none of them)
RUNTIME_FIELDS = {"qb_num_bins", "qb_frozen", "gradient_checkpointing", "kernel_backend", "expert_precision",
                  "max_position_embeddings",
                  "linear_attn_config.chunk_size", "vision_config.vt_attention", "vision_config.in_patch_limit",
                  "vision_config.patch_limit_on_one_side", "vision_config.video_in_patch_limit"}


def architecture_differences(config: K3Config, checkpoint: str | Path) -> str:
    """The fields (but RUNTIME_FIELDS) in which the checkpoint's config.json differs from `config`,
    as "name (checkpoint a, model b); ..."; empty when they agree or the directory has no config.json."""
    path = Path(checkpoint) / "config.json"
    if not path.exists():
        return ""
    theirs = _flat(K3Config.from_hf(path).model_dump())
    ours = _flat(config.model_dump())
    diff = [f"{k} (checkpoint {theirs.get(k)!r}, model {ours.get(k)!r})" for k in sorted(set(ours) | set(theirs))
            if k not in RUNTIME_FIELDS and theirs.get(k) != ours.get(k)]
    return "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
