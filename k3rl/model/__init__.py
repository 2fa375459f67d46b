"""The Kimi K3 model (arXiv 2607.24653) in plain PyTorch (docs/model.md §1-§7): KDA, Gated MLA,
Block AttnRes, Stable LatentMoE with Quantile Balancing, MoonViT-V2, incremental decoding, checkpoints in the
release's layout (its names, MXFP4 experts: docs/model.md §12)."""

from . import mxfp4
from .cache import K3Cache
from .checkpoint import CheckpointMismatchError, load_state_into, save_hf
from .config import K3Config, LinearAttnConfig, VisionConfig
from .factory import build_model, load_hf, model_config
from .load_plan import plan_loading
from .model import K3ForCausalLM
from .params import count_parameters, count_vision_parameters
from .quantile_balance import bias_from_histogram, quantile_balance, required_bias_histogram
from .vision_preprocess import MediaBatch, preprocess_media

__all__ = [
    "CheckpointMismatchError",
    "K3Cache",
    "K3Config",
    "K3ForCausalLM",
    "LinearAttnConfig",
    "MediaBatch",
    "VisionConfig",
    "bias_from_histogram",
    "build_model",
    "count_parameters",
    "count_vision_parameters",
    "load_hf",
    "load_state_into",
    "model_config",
    "mxfp4",
    "plan_loading",
    "preprocess_media",
    "quantile_balance",
    "required_bias_histogram",
    "save_hf",
]
