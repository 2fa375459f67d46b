"""LoRA adapters on the K3 model: low-rank updates W + (alpha / r) * B @ A on chosen weights.

    settings = LoraSettings(rank=8, alpha=16, dropout=0.05, targets=ATTENTION + SHARED_EXPERTS)
    adapters = apply_lora(model, settings)      # {weight name: LoraAdapter}; everything else frozen
    ...train model.parameters() that require grad (the adapters)...
    adapter_state_dict(model)                   # what a weight sync sends: only the adapters (PEFT names)
    merged_state_dict(model)                    # or W + BA for every target, under the model's own names
    save_peft_adapter(model, "out/", settings)  # adapter_config.json + adapter_model.safetensors (PEFT layout)

Targets are regular expressions searched in a weight's name (`model.layers.3.self_attn.q_proj.weight`,
`model.layers.1.mlp.experts.w1`); `ATTENTION`, `SHARED_EXPERTS`, `ROUTED_EXPERTS` and `LATENT`
name the usual groups. A linear layer's adapter runs beside it (`x -> base(x) + s * B(A(dropout(x)))`,
a forward hook: the base weight and its name stay as they are). The routed experts are stacked
`[E, out, in]` tensors that the MoE kernels read directly, so each gets one adapter per expert
(A `[E, r, in]`, B `[E, out, r]`) applied to the weight itself (a parametrization: the kernels
see W + s * B @ A); dropout does not apply there. B starts at zero, so a fresh adapter changes nothing.

PEFT layout: tensors `base_model.model.<release name>.lora_A.weight` `[r, in]` and `.lora_B.weight`
`[out, r]`, the release's names from `state_dict_adapter` (a routed expert e of `experts.w1` is
`...block_sparse_moe.experts.<e>.w1`), and `adapter_config.json` with `peft_type: "LORA"`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize

from k3rl.model.state_dict_adapter import expert_names, hf_name, is_stacked_experts

ATTENTION = [r"self_attn\.(q|k|v|o|g|q_a|q_b|kv_a_proj_with_mqa|kv_b)_proj\.weight$"]
SHARED_EXPERTS = [r"shared_experts\.(gate|up|down)_proj\.weight$"]
ROUTED_EXPERTS = [r"mlp\.experts\.w[123]$"]
LATENT = [r"routed_expert_(down|up)_proj\.weight$"]
GROUPS = {"attention": ATTENTION, "shared_experts": SHARED_EXPERTS, "routed_experts": ROUTED_EXPERTS, "latent": LATENT}
PEFT_PREFIX = "base_model.model."
SCALING_NAME = PEFT_PREFIX + "lora_scaling"  # the 0-dim alpha / r beside the adapters in a weight sync


class LoraSettings(BaseModel):
    """What to adapt and how: rank r, alpha (the update is scaled by alpha / r), input dropout, targets."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] = Field(default_factory=lambda: ATTENTION + SHARED_EXPERTS + LATENT,
                               description="regular expressions searched in weight names")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(nn.Module):
    """A and B of one weight `[..., out, in]` (leading dims: one adapter per expert)."""

    def __init__(self, weight: torch.Tensor, settings: LoraSettings) -> None:
        super().__init__()
        *lead, out, inp = weight.shape
        r = settings.rank
        self.lora_A = nn.Parameter(torch.empty(*lead, r, inp, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(*lead, out, r, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_A.view(-1, inp), a=math.sqrt(5))  # as nn.Linear initialises
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout)

    def delta(self) -> torch.Tensor:
        """s * B @ A, the shape of the adapted weight."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def beside(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to a linear layer's output: s * B(A(dropout(x)))."""
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        return self.scaling * (self.dropout(x) @ a.T @ b.T)


class _Beside:
    """Forward hook of an adapted linear layer: out + s * B(A(dropout(x))). An object, not a closure,
    so that a deep copy of the model (the KL reference) gets hooks that call its own copies."""

    def __init__(self, adapter: LoraAdapter) -> None:
        self.adapter = adapter

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out + self.adapter.beside(args[0])


class _AddDelta(nn.Module):
    """Parametrization of a stacked expert weight: W -> W + s * B @ A (the adapter lives in the model's
    `lora_adapters`, not here, so its parameters are registered once)."""

    def __init__(self, adapter: LoraAdapter) -> None:
        super().__init__()
        self._adapter = (adapter,)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self._adapter[0].delta().to(weight.dtype)


def apply_lora(model: nn.Module, settings: LoraSettings) -> dict[str, LoraAdapter]:
    """Add an adapter to every weight whose name matches a target, freeze every other parameter.
    Returns {weight name: adapter}; the adapters are `model.lora_adapters` (trainable)."""
    if hasattr(model, "lora_adapters"):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    patterns = [re.compile(p) for p in settings.targets]
    names = [n for n, _ in model.named_parameters() if any(p.search(n) for p in patterns)]
    bad = [n for n in names if not (n.endswith(".weight") or is_stacked_experts(n))]
    if bad:
        raise ValueError(f"LoRA targets {bad[:3]} are neither linear weights nor stacked experts; narrow targets")
    if not names:
        raise ValueError(f"no weight of the model matches the LoRA targets {settings.targets}; "
                         "see k3rl.model.lora.ATTENTION / SHARED_EXPERTS / ROUTED_EXPERTS / LATENT")
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: dict[str, LoraAdapter] = {}
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        adapter = adapters[name] = LoraAdapter(getattr(owner, attr), settings)
        if isinstance(owner, nn.Linear):
            owner.register_forward_hook(_Beside(adapter))
        else:
            parametrize.register_parametrization(owner, attr, _AddDelta(adapter))
    model.lora_adapters = nn.ModuleDict({_key(n): a for n, a in adapters.items()})
    return adapters


def adapters_of(model: nn.Module) -> dict[str, LoraAdapter]:
    """{weight name: adapter} of a model `apply_lora` adapted."""
    return {_name(k): a for k, a in model.lora_adapters.items()}


def _key(name: str) -> str:
    return name.replace(".", "__")


def _name(key: str) -> str:
    return key.replace("__", ".")


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own weights without the adapters, under a plain model's names (views of the
    parameters: loading into them loads the model)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("lora_adapters."):
            continue
        plain = re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", key)
        if ".parametrizations." not in plain:
            out[plain] = value.detach()
    return out


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged in (W + s * B @ A), under a plain model's names."""
    out = base_state_dict(model)
    with torch.no_grad():
        for name, adapter in adapters_of(model).items():
            out[name] = out[name] + adapter.delta().to(out[name].dtype)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone, under PEFT's names (what a LoRA weight sync or checkpoint holds)."""
    out = {}
    for name, adapter in adapters_of(model).items():
        a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
        if is_stacked_experts(name):
            for e in range(a.shape[0]):
                stem = expert_names(name, e, "dense")[0].removesuffix(".weight")
                out[f"{PEFT_PREFIX}{stem}.lora_A.weight"], out[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = a[e], b[e]
        else:
            stem = hf_name(name).removesuffix(".weight")
            out[f"{PEFT_PREFIX}{stem}.lora_A.weight"], out[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = a, b
    return out


def is_adapter_update(names) -> bool:
    """Whether a weight update's tensor names are adapters (`adapter_state_dict`), not weights."""
    return SCALING_NAME in names


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights an adapters-only update stands for: W + s * B @ A for every adapter pair of
    `adapters` (PEFT names, plus `SCALING_NAME`), where `base` holds W under the release's names
    (per-expert names for routed experts). Returns {release name: merged weight} in W's dtype."""
    scaling = float(adapters[SCALING_NAME])
    merged = {}
    for key, a in adapters.items():
        if not key.endswith(".lora_A.weight"):
            continue
        stem = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        name = stem + ".weight"
        if name not in base:
            raise ValueError(f"adapter {key} adapts {name}, which the engine's model does not have; the learner and "
                             "the engines must build the same model (model.preset / overrides)")
        b = adapters[f"{PEFT_PREFIX}{stem}.lora_B.weight"]
        w = base[name]
        delta = scaling * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))
        merged[name] = (w.float() + delta).to(w.dtype)
    return merged


def lora_targets(adapters) -> list[str]:
    """The release names of the weights an adapters-only update adapts."""
    return [k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight"
            for k in adapters if k.endswith(".lora_A.weight")]


def peft_config(model: nn.Module, settings: LoraSettings, base_model: str | None = None) -> dict:
    """`adapter_config.json` of the adapters: PEFT's LoraConfig fields."""
    modules = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in adapter_state_dict(model)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "bias": "none",
            "target_modules": modules, "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True}


def save_peft_adapter(model: nn.Module, directory: str | Path, settings: LoraSettings,
                      base_model: str | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (written aside, then renamed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    for name, write in (("adapter_model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})),
                        ("adapter_config.json", lambda p: p.write_text(
                            json.dumps(peft_config(model, settings, base_model), indent=2)))):
        partial = directory / (name + ".partial")
        write(partial)
        partial.rename(directory / name)
    return directory


def load_peft_adapter(model: nn.Module, directory: str | Path) -> None:
    """Load adapters `save_peft_adapter` wrote into a model adapted with the same settings."""
    saved = load_file(str(Path(directory) / "adapter_model.safetensors"))
    wanted = adapter_state_dict(model)
    if set(saved) != set(wanted):
        missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
        raise ValueError(f"{directory}: the adapters do not match the model's (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}); adapt the model with the settings they were trained with")
    with torch.no_grad():
        for name, value in wanted.items():
            value.copy_(saved[name])  # views of the adapters' parameters
