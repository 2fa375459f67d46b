"""`model:` the K3 preset, its overrides, checkpoint, tokenizer and dtype."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from .base import ConfigError, _format, _refuse, _Section


class ModelSection(_Section):
    preset: Literal["k3", "k3-small", "k3-tiny"] = "k3-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields replacing the preset's")
    checkpoint: str | None = Field(None, description="HF-layout directory to load the weights from")
    tokenizer: str = Field("byte", description="'byte', or a directory with the checkpoint's tiktoken.model + "
                                               "tokenizer_config.json (the official K3 files), or a tokenizer.json")
    dtype: Literal["float32", "bfloat16"] = "float32"
    thinking: bool = Field(False, description="thinking mode of the chat template")
    seed: int = 0
    expert_precision: Literal["bf16", "mxfp4"] = Field(
        "bf16", description="the routed experts' GEMMs in the engines and the learner alike: 'bf16' as the weights "
                            "are, or 'mxfp4', K3's precision recipe: MXFP4 weights (E2M1, one E8M0 scale per 32) and "
                            "MXFP8 activations (E4M3, one E8M0 scale per 32); the learner trains its fp32 master "
                            "weights through the quantisation with a straight-through estimator")

    @field_validator("overrides")
    @classmethod
    def _precision_not_in_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        if "expert_precision" in overrides:
            _refuse([("expert_precision", "set model.expert_precision instead (the engines and the learner read it)")])
        return overrides

    @property
    def k3_overrides(self) -> dict[str, Any]:
        """The K3Config fields this section replaces in the preset: `overrides` and `expert_precision`."""
        return {**self.overrides, "expert_precision": self.expert_precision}

    def k3_config(self):
        """The K3Config this section describes (preset + overrides), validated: the one combination
        of the two (`k3rl.model.model_config`) that the learner and the engines build from."""
        # lazy: k3rl.model.config is pydantic only, but k3rl.config must not import the model package
        from k3rl.model.config import model_config

        try:
            return model_config(self.preset, self.k3_overrides)
        except ValidationError as e:
            raise ConfigError(_format(e, prefix="model.overrides")) from None

    def _k3_config_or_problems(self) -> tuple[Any, list[tuple[str, str]]]:
        # lazy: k3rl.model.config is pydantic only, but k3rl.config must not import the model package
        from k3rl.model.config import K3Config

        try:
            return K3Config.model_validate({**K3Config.preset(self.preset).model_dump(), **self.k3_overrides}), []
        except ValidationError as e:
            return None, [(f"overrides.{'.'.join(str(p) for p in err['loc'])}".rstrip("."),
                           err["msg"].removeprefix("Value error, ") if err["type"] != "extra_forbidden" else "not a K3Config field")
                          for err in e.errors()]
