"""How environments from outside k3rl get registered, and the check of a job's env ids.

Two routes, both ending in `gymnasium.register(...)` calls:

* `envs.imports: [mypkg.envs, ...]` in the job config: modules imported in every process that
  makes environments (the driver before Ray starts, each rollout worker). A module registers
  its environments when it is imported. `k3rl envs check ID --import mypkg.envs` does the same.
* An installed package declares the entry-point group `k3rl.envs` in its pyproject.toml:

      [project.entry-points."k3rl.envs"]
      mypkg = "mypkg.envs"             # a module: importing it registers the environments
      # or
      mypkg = "mypkg.envs:register"    # a function: called once, it registers them

  `import k3rl.envs` loads every entry point of the group once.

`check_env_ids(cfg)` refuses a job whose env ids are not registered (with Gymnasium's "did you
mean") before anything starts.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import types
import warnings
from importlib.metadata import entry_points
from typing import Any

import gymnasium as gym

from k3rl.config import ConfigError
from k3rl.envs.base import ToolEnv, registered_entry_point

ENTRY_POINT_GROUP = "k3rl.envs"
_loaded: dict[str, str] = {}  # entry-point name -> "ok" or the error text


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> dict[str, str]:
    """Load every entry point of `group` once (a module is imported, a function is called); a failing one
    warns instead of breaking imports."""
    for ep in entry_points(group=group):
        if ep.name in _loaded:
            continue
        try:
            target = ep.load()
            if not isinstance(target, types.ModuleType):
                if not callable(target):
                    raise TypeError(f"entry point {ep.value} is a {type(target).__name__}, not a module or a callable")
                target()
            _loaded[ep.name] = "ok"
        except Exception as e:  # a broken plugin must not break `import k3rl.envs`
            _loaded[ep.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"k3rl.envs entry point {ep.name!r} ({ep.value}) failed to register: {e}", stacklevel=2)
    return dict(_loaded)


def import_env_modules(modules: list[str], field: str = "envs.imports") -> None:
    """Import each module (which registers its environments); a module that cannot be imported raises
    ConfigError naming it, the setting it came from (`field`) and the error.

    Modules are found on PYTHONPATH, in installed packages, and in the current directory (the Ray
    workers of a job get the driver's current directory on their path too, unless the job ships a
    `working_dir`)."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as e:
            where = f"{field}.{i}" if field == "envs.imports" else field
            raise ConfigError(
                f"{where}: cannot import {name!r}: {type(e).__name__}: {e}. Put the directory that holds it on "
                f"PYTHONPATH or install its package; on a Ray cluster, ship it with ray.runtime_env "
                f"(working_dir or py_modules)") from e


def unknown_env_message(env_id: str) -> str | None:
    """None when `env_id` is registered, else Gymnasium's own error text (with its "did you mean", or the
    closest registered ids when Gymnasium has none)."""
    try:
        gym.spec(env_id)
        return None
    except gym.error.Error as e:
        message = str(e)
    if "Did you mean" not in message:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
        if close:
            message += " Did you mean: " + ", ".join(f"`{c}`" for c in close) + "?"
    return message


def check_env_ids(cfg: Any) -> None:
    """Import `cfg.envs.imports`, then refuse (ConfigError) every `envs.train[i].id` and `envs.eval[i].id`
    that is not registered or is not a ToolEnv. Call it before Ray starts."""
    import_env_modules(cfg.envs.imports)
    problems = []
    for section in ("train", "eval"):
        for i, spec in enumerate(getattr(cfg.envs, section, [])):
            message = unknown_env_message(spec.id) or _not_a_tool_env(spec.id)
            if message:
                problems.append(f"envs.{section}.{i}.id: {message}")
    if problems:
        hint = ("an environment of your own is registered by a module listed in envs.imports, or by a package's "
                "k3rl.envs entry point; `k3rl envs list` shows what is registered")
        raise ConfigError("\n  ".join(["environments the job cannot use:", *problems, hint]))


def _not_a_tool_env(env_id: str) -> str | None:

    try:
        creator = registered_entry_point(env_id)
    except Exception as e:
        return (f"{env_id!r} is registered, but its entry point {gym.spec(env_id).entry_point!r} cannot be loaded: "
                f"{type(e).__name__}: {e}")
    if isinstance(creator, type) and not issubclass(creator, ToolEnv) and not getattr(creator, "is_agent_env", False):
        return (f"{env_id!r} is a {creator.__name__}, not a k3rl.envs.ToolEnv: the agent loop talks to "
                f"environments in chat messages and tools (see `k3rl envs list`)")
    return None
