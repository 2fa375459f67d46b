"""k3rl's example jobs (`*.yaml`), their stored warm starts and a custom-environment example,
installed with the package as `k3rl.examples` so a wheel install can run them too: `k3rl train demo.yaml`
from any directory takes the installed example when no file of that name is there (`path` finds them)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def path(name: str) -> Path:
    """The installed path of an example file (e.g. "demo.yaml", "keylookup_warm_start")."""
    p = HERE / name
    if not p.exists():
        choices = sorted(q.name for q in HERE.iterdir() if not q.name.startswith(("_", ".")))
        raise FileNotFoundError(f"no example {name!r}; the examples are: {', '.join(choices)}")
    return p
