"""Loading environments from other packages through the entry-point group `k3rl.envs`.

A third-party package declares, in its pyproject.toml,

    [project.entry-points."k3rl.envs"]
    mypkg = "mypkg.envs:register"

where `register()` calls `gymnasium.register("mypkg/MyEnv-v0", entry_point=...)`.
`import k3rl.envs` calls every such function once.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "k3rl.envs"
_loaded: dict[str, str] = {}  # entry-point name -> "ok" or the error text


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> dict[str, str]:
    """Call every registration function of `group` once; a failing one warns instead of breaking imports."""
    for ep in entry_points(group=group):
        if ep.name in _loaded:
            continue
        try:
            register = ep.load()
            if not callable(register):
                raise TypeError(f"entry point {ep.value} is a {type(register).__name__}, not a callable")
            register()
            _loaded[ep.name] = "ok"
        except Exception as e:  # a broken plugin must not break `import k3rl.envs`
            _loaded[ep.name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"k3rl.envs entry point {ep.name!r} ({ep.value}) failed to register: {e}", stacklevel=2)
    return dict(_loaded)

