"""The embedded K3 engine."""

from .contract import EngineLoad, FinishReason, GenerationResult, InferenceEngine
from .embedded import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EngineLoad", "FinishReason", "GenerationResult", "InferenceEngine"]
