"""`k3rl/Agent-v0`: a user's agent harness as an environment.

    envs:
      train: [{id: k3rl/Agent-v0, kwargs: {agent: "my_pkg.agent:solve", tasks: "my_pkg.agent:TASKS"}}]

`tasks` names a list of JSON-able dicts (task `seed % len`) or a callable giving one from a seed;
`agent` names `solve(base_url, model, task) -> float`, which runs the user's agent against an
OpenAI-compatible endpoint (`base_url` ends in `/v1`) with any client and returns the reward, or raises,
which fails the episode with the agent's traceback stored. The rollout drives the episode
(`rollout/agent_episode.py`): it serves the endpoint, calls `solve` in a thread of the rollout worker's
process, and trains on the tokens the endpoint recorded. `step` is never called.

With `sandboxed: true` the agent runs inside the episode's sandbox (the job's `sandbox` settings: Docker,
or bubblewrap), which keeps no network: `solve`'s module file is copied in and imported there alone (its
imports must be in the sandbox's image; the default image has the standard library, numpy, matplotlib and
Pillow, so an agent talks HTTP with `urllib`), and its `base_url` is a port on the sandbox's own loopback
relayed over the sandbox's agent channel to the worker's endpoint (`k3rl.sandboxes.host_call`). The agent's
tools (a shell, files) then act inside the sandbox; `task` crosses as JSON, the reward comes back as JSON.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from k3rl.envs.spaces import AssistantAction


def load_object(path: str, what: str) -> Any:
    """The object a 'module:attribute' path names, or a clear error saying what is wrong with it."""
    module, sep, name = str(path).partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what} {path!r} must be 'module:attribute' (e.g. my_pkg.agent:solve)")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import {module!r} ({e}); is it installed, or on PYTHONPATH in "
                         "every rollout worker (ray.runtime_env)?") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: module {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


class AgentEnv(gym.Env):
    """A user's agent and tasks; see the module doc."""

    is_agent_env = True  # the rollout runs `solve` against its endpoint instead of calling step()

    def __init__(self, agent: str, tasks: str, max_calls: int = 32, sandboxed: bool = False,
                 time_budget_s: float = 600.0, sandbox_factory: Callable[[], Any] | None = None,
                 sandbox_release: Callable[[Any], None] | None = None, sandbox_backend: str = "auto",
                 sandbox_limits: dict[str, Any] | None = None, **task_kwargs: Any) -> None:
        self.agent_fn = load_object(agent, "envs.train.kwargs.agent")
        if not callable(self.agent_fn):
            raise ValueError(f"agent {agent!r} is not callable: it must be solve(base_url, model, task) -> float")
        self.sandboxed, self.time_budget_s = bool(sandboxed), float(time_budget_s)
        self.solve = self.solve_in_sandbox if self.sandboxed else self.agent_fn
        if self.sandboxed:
            self.agent_file = inspect.getsourcefile(self.agent_fn)
            if self.agent_file is None:
                raise ValueError(f"agent {agent!r}: sandboxed: true copies the agent's module file into the "
                                 "sandbox, and this function has none (defined in a notebook or interactively?)")
            self._sandbox_factory, self._sandbox_release = sandbox_factory, sandbox_release
            self.sandbox_backend, self.sandbox_limits = sandbox_backend, dict(sandbox_limits or {})
        self.tasks = load_object(tasks, "envs.train.kwargs.tasks")
        if not callable(self.tasks) and not (isinstance(self.tasks, (list, tuple)) and self.tasks):
            raise ValueError(f"tasks {tasks!r} must be a non-empty list of dicts or a callable(seed) -> dict")
        self.max_calls, self.task_kwargs = max_calls, task_kwargs
        self.task: dict[str, Any] = {}
        # the task as JSON text; an action is an assistant message, which the agent's calls produce instead
        self.observation_space = AssistantAction(max_length=1 << 20)
        self.action_space = AssistantAction()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        seed = 0 if seed is None else int(seed)
        task = self.tasks(seed, **self.task_kwargs) if callable(self.tasks) else self.tasks[seed % len(self.tasks)]
        if not isinstance(task, dict):
            raise ValueError(f"task {seed} is a {type(task).__name__}; tasks must be JSON-able dicts")
        self.task = json.loads(json.dumps(task))  # JSON-able, and the agent gets its own copy
        return json.dumps(self.task, sort_keys=True), {"task_id": str(self.task.get("id", seed)), "task": self.task}

    def solve_in_sandbox(self, base_url: str, model: str, task: dict[str, Any]) -> Any:
        """`solve` run inside a sandbox of its own (see the module doc); its traceback when it raises."""
        # the sandbox backends (docker's client among them) load only for a sandboxed agent
        from k3rl.sandboxes import open_sandbox
        from k3rl.sandboxes.host_call import call_in_sandbox

        sb = self._sandbox_factory() if self._sandbox_factory is not None else \
            open_sandbox(backend=self.sandbox_backend, **self.sandbox_limits)
        try:
            return call_in_sandbox(sb, self.agent_file, self.agent_fn.__name__, [base_url, model, task], url_arg=0,
                                   host_url=base_url, timeout_s=self.time_budget_s)
        finally:
            if self._sandbox_release is not None:
                self._sandbox_release(sb)
            else:
                sb.close()

    def step(self, action: Any):
        raise RuntimeError("k3rl/Agent-v0 is driven by its agent through the chat endpoint; step() is not used")
