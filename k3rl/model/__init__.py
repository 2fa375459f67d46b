"""The Kimi K3 model (arXiv 2607.24653) in plain PyTorch (docs/model.md §1-§7): KDA, Gated MLA,
Block AttnRes, Stable LatentMoE with Quantile Balancing, MoonViT-V2, incremental decoding, checkpoints in the
release's layout (its names, MXFP4 experts: docs/model.md §12)."""

from __future__ import annotations

from k3rl.lazy import lazy_getattr

# name -> submodule; imported on first use, so that `k3rl.model.config` (pydantic only: what a JobConfig
# validates against) does not pull in torch and the model in processes that never build one (rollout
# workers, the trajectory buffer, the CLI). The function quantile_balance is imported from its module
# k3rl.model.quantile_balance: a lazy package attribute of that name would be the module once imported.
_EXPORTS = {
    "mxfp4": None,
    "K3Cache": "cache",
    "CheckpointMismatchError": "checkpoint", "load_state_into": "checkpoint", "save_hf": "checkpoint",
    "K3Config": "config", "LinearAttnConfig": "config", "VisionConfig": "config",
    "build_model": "factory", "load_hf": "factory", "model_config": "config",
    "plan_loading": "load_plan",
    "K3ForCausalLM": "model",
    "count_parameters": "params", "count_vision_parameters": "params",
    "bias_from_histogram": "quantile_balance", "required_bias_histogram": "quantile_balance",
    "MediaBatch": "vision_preprocess", "preprocess_media": "vision_preprocess",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
