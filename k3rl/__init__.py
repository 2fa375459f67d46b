"""k3rl: agentic RL post-training for Kimi K3-architecture models."""

from k3rl.types import SamplingParams, ToolCall, Trajectory, Turn, WeightBucket, WeightUpdate

__version__ = "0.1.0"
__all__ = ["SamplingParams", "ToolCall", "Trajectory", "Turn", "WeightBucket", "WeightUpdate", "__version__"]
