"""One job configuration: `JobConfig`, loaded from YAML with `--set a.b.c=value` overrides.

Unknown keys, bad values and combinations of fields that cannot work together are rejected
before anything starts, each with the dotted path of the field and what to change
(`ConfigError`). Combinations that work but may surprise are listed by `JobConfig.notes()`.
The validated config (every default filled in) is what gets printed, saved next to a run and
logged to MLflow as params.

Sections live in modules by name: `model`, `rollout`, `learner`, `envs`, `services` (sandbox,
tracking, ray); `job` joins them into `JobConfig`; `base` holds `ConfigError`; `overrides` the
`--set` syntax.
"""

from .base import ConfigError, FieldProblems
from .envs import IMAGE_ENVS, EnvSpec, EnvsSection, EvalSpec
from .job import POST_TRAINING_LR, JobConfig
from .learner import (
    LORA_GROUPS,
    DistillSection,
    GuardSection,
    LearnerSection,
    LoraSection,
    MoonEPSection,
    SftPhase,
    TeacherSpec,
)
from .model import ModelSection
from .overrides import apply_override
from .rollout import ContextSection, RolloutSection, SamplingSection
from .services import RaySection, SandboxSection, TrackingSection

__all__ = [
    "IMAGE_ENVS", "LORA_GROUPS", "POST_TRAINING_LR", "ConfigError", "ContextSection", "DistillSection", "EnvSpec",
    "EnvsSection", "EvalSpec", "FieldProblems", "GuardSection", "JobConfig", "LearnerSection", "LoraSection",
    "ModelSection", "MoonEPSection", "RaySection", "RolloutSection", "SamplingSection", "SandboxSection",
    "SftPhase", "TeacherSpec", "TrackingSection", "apply_override",
]
