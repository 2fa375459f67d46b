"""`JobConfig`: the sections together, the checks across sections, `notes()`, and loading from
YAML with overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from k3rl.tokenizer import ByteTokenizer

from .base import ConfigError, _format, _refuse, _Section
from .envs import IMAGE_ENVS, EnvsSection
from .learner import LearnerSection
from .model import ModelSection
from .overrides import apply_override
from .rollout import RolloutSection
from .services import RaySection, SandboxSection, TrackingSection

# Post-training peak learning rates (RL, SFT warm start) per preset, used when a job leaves
# learner.lr / learner.sft_lr unset. Post-training moves a trained model a little: rates one to
# two orders below pre-training's, smaller the wider the model (Muon's update RMS is matched to
# AdamW's, so these read as AdamW rates). k3-tiny's are the demo's, measured (docs/learning.md):
# RL at 1e-4 keeps the held-out success over 30 steps (at 1e-3 one update already drops confident
# tokens by 9 nats); SFT at 3e-3 over 60 steps learns the copies KeyLookup needs (greedy held-out
# success 0.72), at 1e-2 only the message format (0.03). k3-small's and k3's follow the width
# scaling of published post-training and are not measured here.
POST_TRAINING_LR: dict[str, tuple[float, float]] = {
    "k3-tiny": (1e-4, 3e-3),
    "k3-small": (1e-5, 1e-4),
    "k3": (2e-6, 1e-5),
}


class JobConfig(_Section):
    name: str = "k3rl-job"
    model: ModelSection = Field(default_factory=ModelSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    envs: EnvsSection = Field(default_factory=EnvsSection)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    ray: RaySection = Field(default_factory=RaySection)

    @model_validator(mode="before")
    @classmethod
    def _post_training_lr(cls, data: Any) -> Any:
        """learner.lr and learner.sft_lr, when left unset, from the preset's POST_TRAINING_LR."""
        if not isinstance(data, dict) or not isinstance(data.get("learner", {}), dict):
            return data
        model = data.get("model", {})
        preset = model.get("preset", "k3-tiny") if isinstance(model, dict) else getattr(model, "preset", "k3-tiny")
        if preset not in POST_TRAINING_LR:
            return data  # the preset field reports the unknown name
        learner = dict(data.get("learner", {}))
        lr, sft_lr = POST_TRAINING_LR[preset]
        learner.setdefault("lr", lr)
        learner.setdefault("sft_lr", sft_lr)
        return {**data, "learner": learner}

    @model_validator(mode="after")
    def _refuse_what_cannot_work(self):
        _refuse(self._model_problems() + self._engine_problems() + self._weight_transport_problems()
                + self._sandbox_problems() + self._context_parallel_problems() + self._sft_phase_problems())
        return self

    def _context_parallel_problems(self) -> list[tuple[str, str]]:
        if self.learner.context_parallel == 1:
            return []
        return [(f"envs.{section}.{i}.id", f"{spec.id} puts images in the prompts, and the vision tower does not "
                                           f"run context-parallel; set learner.context_parallel: 1")
                for section in ("train", "eval") for i, spec in enumerate(getattr(self.envs, section))
                if spec.id in IMAGE_ENVS]

    def _model_problems(self) -> list[tuple[str, str]]:
        k3, problems = self.model._k3_config_or_problems()
        problems = [(f"model.{path}", message) for path, message in problems]
        if k3 is None:
            return problems
        ep = self.learner.expert_parallel
        if ep > 1 and k3.num_experts % ep:
            problems.append(("learner.expert_parallel", f"learner.expert_parallel={ep} must divide the model's "
                                                        f"num_experts={k3.num_experts}"))
        problems += self._moon_ep_problems(k3.num_experts)
        if k3.expert_precision == "mxfp4" and ep > 1:  # the sharded expert paths run the bf16 GEMMs
            problems.append(("learner.expert_parallel", f"learner.expert_parallel={ep} shards the routed experts, and "
                                                        "the sharded paths have no MXFP4 yet; keep it 1 with "
                                                        "model.expert_precision 'mxfp4'"))
        if self.model.tokenizer == "byte" and k3.vocab_size < ByteTokenizer.vocab_size:
            problems.append(("model.overrides.vocab_size", f"{k3.vocab_size} is smaller than the byte tokenizer's "
                                                           f"{ByteTokenizer.vocab_size} ids; raise it, or set "
                                                           f"model.tokenizer to the directory of a real tokenizer (the checkpoint's tiktoken.model + tokenizer_config.json)"))
        return problems

    def _moon_ep_problems(self, num_experts: int) -> list[tuple[str, str]]:
        moon, learner = self.learner.moon_ep, self.learner
        if not moon.enabled or learner.expert_parallel < 2:
            return []
        problems = []
        most = num_experts - num_experts // learner.expert_parallel
        if moon.slots > most:
            problems.append(("learner.moon_ep.slots", f"{moon.slots} is more than the {most} experts a rank is not "
                                                      f"home to (num_experts={num_experts}, expert_parallel="
                                                      f"{learner.expert_parallel}); lower it"))
        if self.rollout.max_context_tokens > learner.micro_batch_tokens:
            problems.append(("learner.moon_ep", f"MoonEP sizes its dispatch for micro_batch_tokens="
                                                f"{learner.micro_batch_tokens} tokens a rank, but an episode of "
                                                f"rollout.max_context_tokens={self.rollout.max_context_tokens} makes a "
                                                f"longer micro-batch; raise learner.micro_batch_tokens to at least "
                                                f"{self.rollout.max_context_tokens}"))
        return problems

    def _engine_problems(self) -> list[tuple[str, str]]:
        if self.rollout.engine != "vllm":
            return []
        problems = []
        if self.learner.lora is not None and self.learner.lora.sync == "adapters":
            problems.append(("learner.lora.sync", "rollout.engine 'vllm' takes whole weights; set "
                                                  "learner.lora.sync: merged (or rollout.engine: embedded)"))
        if self.rollout.sampling.temperature not in (0.0, 1.0):
            problems.append(("rollout.sampling.temperature", "rollout.engine 'vllm' reports log-probs at temperature 1 "
                             "(logprobs_mode raw_logprobs), and the learner trains softmax(logits / temperature): "
                             "set temperature 1 (or rollout.engine: embedded)"))
        if self.learner.routing_replay:
            problems.append(("learner.routing_replay", "rollout.engine 'vllm' does not return the routed experts "
                                                       "that routing replay trains with; set "
                                                       "learner.routing_replay: false (or rollout.engine: embedded)"))
        if self.rollout.compile_decode:
            problems.append(("rollout.compile_decode", "compiles the embedded engine's decode step; vLLM compiles "
                                                       "its own: set false with rollout.engine: vllm"))
        if self.rollout.prefill_graphs:
            problems.append(("rollout.prefill_graphs", "graphs the embedded engine's prefill; vLLM captures its "
                                                       "own: set false with rollout.engine: vllm"))
        if self.rollout.prefill_wait_steps:
            problems.append(("rollout.prefill_wait_steps", "schedules the embedded engine's prefills; vLLM schedules "
                                                           "its own: set 0 with rollout.engine: vllm"))
        if not self.model.checkpoint:
            problems.append(("model.checkpoint", "rollout.engine 'vllm' serves an HF-layout checkpoint directory; "
                                                 "set model.checkpoint to one (save_hf writes it), or use "
                                                 "rollout.engine: embedded"))
        for section in ("train", "eval"):
            for i, spec in enumerate(getattr(self.envs, section)):
                if spec.id in IMAGE_ENVS:
                    problems.append((f"envs.{section}.{i}.id", f"{spec.id} puts images in the prompts, and "
                                     "rollout.engine 'vllm' serves text only (k3rl's K3 model class for vLLM has "
                                     "no image input); use rollout.engine: embedded"))
        return problems

    def _weight_transport_problems(self) -> list[tuple[str, str]]:
        t, learner_gpus, engine_gpus = self.rollout.weight_transport, self.learner.gpus, self.rollout.gpus_per_inference_worker
        where = "rollout.weight_transport"
        if t == "nccl" and (learner_gpus > 0) != (engine_gpus > 0):
            return [(where, f"'nccl' needs the learner and the engines on the same kind of device "
                            f"(learner.gpus={learner_gpus}, rollout.gpus_per_inference_worker={engine_gpus}): NCCL "
                            f"between GPUs, gloo between CPU processes")]
        if t == "nccl" and engine_gpus > 0 and (engine_gpus < 1 or learner_gpus / self.learner.world_size < 1):
            return [(where, f"'nccl' needs one whole GPU per process (learner.gpus={learner_gpus} over "
                            f"{self.learner.world_size} rank(s), rollout.gpus_per_inference_worker={engine_gpus}): "
                            f"NCCL cannot connect two processes on one GPU; use 'cuda_ipc' when the engines share the "
                            f"learner's GPU")]
        if t == "cuda_ipc" and not (learner_gpus > 0 and engine_gpus > 0):
            return [(where, f"'cuda_ipc' needs the learner and the engines on GPUs of one host "
                            f"(learner.gpus={learner_gpus}, rollout.gpus_per_inference_worker={engine_gpus})")]
        return []

    def _sft_phase_problems(self) -> list[tuple[str, str]]:
        ids = [e.id for e in self.envs.train]
        why = f"is not in envs.train ({', '.join(ids)}); a phase trains on demonstrations of envs.train's entries"
        return [(f"learner.sft_phases.{i}.{field}", f"{env!r} {why}")
                for i, p in enumerate(self.learner.sft_phases)
                for field, named in (("envs", p.envs or []), ("env_kwargs_by_env", p.env_kwargs_by_env))
                for env in named if env not in ids]

    def _sandbox_problems(self) -> list[tuple[str, str]]:
        if self.sandbox.image and self.sandbox.backend in ("bwrap", "none"):
            return [("sandbox.image", f"{self.sandbox.image!r} is a Docker image, but sandbox.backend is {self.sandbox.backend!r}; "
                                      f"set sandbox.backend: docker (or auto), or remove sandbox.image")]
        return []

    def notes(self) -> list[str]:
        """Settings that work but may not do what was meant (printed by `k3rl train` and `k3rl config show`)."""
        out = []
        learner, episodes = self.learner, self.rollout.prompts_per_step * self.rollout.group_size
        if learner.checkpoint_every > learner.steps:
            out.append(f"learner.checkpoint_every={learner.checkpoint_every} is more than learner.steps="
                       f"{learner.steps}: only the final checkpoint is written")
        if learner.steps == 0 and learner.sft_steps == 0:
            out.append("learner.steps and learner.sft_steps are 0: the job trains nothing")
        if self.tracking.sample_episodes > episodes:
            out.append(f"tracking.sample_episodes={self.tracking.sample_episodes} is more than the {episodes} "
                       f"episodes of a step (rollout.prompts_per_step x rollout.group_size): all of them are logged")
        if self.sandbox.pool_size > self.sandbox.max_concurrency:
            out.append(f"sandbox.pool_size={self.sandbox.pool_size} is more than sandbox.max_concurrency="
                       f"{self.sandbox.max_concurrency}: at most {self.sandbox.max_concurrency} are kept warm")
        return out

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
        data: dict[str, Any] = {}
        if path is not None:
            path = Path(path)
            if not path.exists():
                raise ConfigError(f"config file {path} does not exist")
            try:
                with open(path, encoding="utf-8") as f:  # a file: YAML's errors name it (a string is "<unicode string>")
                    data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path} must hold a mapping at the top level, found {type(data).__name__}")
            _paths_from_file(data, path.parent)
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_format(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
        return path

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values (MLflow params)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for i, v in enumerate(value):
                    walk(f"{prefix}.{i}", v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out


def _paths_from_file(data: dict[str, Any], folder: Path) -> None:
    """A relative model.checkpoint / model.tokenizer written in a config file names a path beside the
    file (examples/demo.yaml's `checkpoint: keylookup_warm_start`), so the job runs from any working
    directory. Made absolute only where that path exists; --set values stay relative to the caller."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    for key in ("checkpoint", "tokenizer"):
        value = model.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (folder / value).exists():
            model[key] = str((folder / value).resolve())
