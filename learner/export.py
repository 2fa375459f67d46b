"""A trainer's weights as a versioned `WeightUpdate` for the engines: every weight under the
release's name (`state_dict_adapter.to_hf`), or with LoRA `sync: adapters` the adapters alone.
`Trainer.export_weights` documents the arguments."""

from __future__ import annotations

import torch

from k3rl.model.lora import SCALING_NAME, adapter_state_dict, merged_state_dict
from k3rl.model.model import FP32_PARAM_SUFFIXES
from k3rl.model.state_dict_adapter import to_hf
from k3rl.types import WeightUpdate


def weight_update(trainer, version: int, dtype: torch.dtype | None, bucket_bytes: int, to_cpu: bool,
                  experts: str | None) -> WeightUpdate:
    """The trainer's policy as a WeightUpdate; collective under FSDP (call on every rank)."""
    if trainer.lora is not None and trainer.lora.sync == "adapters":
        return _adapters_update(trainer, version, bucket_bytes, to_cpu)
    if trainer.lora is not None:
        state = merged_state_dict(trainer.model)
    else:
        state = trainer.full_state_dict()
    if trainer.model_config is not None and getattr(trainer.model_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    hf = to_hf(state, experts=experts or default_expert_format(trainer))
    if dtype is not None:
        hf = {
            k: (v.to(dtype) if v.is_floating_point() and not k.endswith(FP32_PARAM_SUFFIXES) else v)
            for k, v in hf.items()
        }
    hf = {k: (v.detach().cpu() if to_cpu else v.detach()).contiguous() for k, v in hf.items()}
    return WeightUpdate.from_state_dict(version, hf, bucket_bytes=bucket_bytes)


def default_expert_format(trainer) -> str:
    """How a weight sync sends the routed experts by default: "mxfp4" when the model computes with
    MXFP4 experts (`expert_precision: mxfp4`; the engines then hold exactly the values the learner's
    forward quantises to, never a bf16 rounding of the masters rounded again, in 4.25 bits a value),
    else as the model's weights came (`model.routed_experts_format`, "mxfp4" from the release)."""
    if getattr(trainer.model_config, "expert_precision", "bf16") == "mxfp4":
        return "mxfp4"
    return getattr(trainer.model, "routed_experts_format", "dense")


def _adapters_update(trainer, version: int, bucket_bytes: int, to_cpu: bool) -> WeightUpdate:
    """LoRA with `sync: adapters`: the adapters alone, in fp32 under PEFT's names, plus the scaling
    alpha / r (`lora.SCALING_NAME`); each engine merges them into its own base weights. Marked
    full: with the base an engine starts from, it makes the whole policy."""
    state = {**adapter_state_dict(trainer.model), SCALING_NAME: torch.tensor(trainer.lora.settings().scaling)}
    state = {k: (v.detach().cpu() if to_cpu else v.detach().to(trainer.device)).contiguous() for k, v in state.items()}
    return WeightUpdate.from_state_dict(version, state, bucket_bytes=bucket_bytes)
