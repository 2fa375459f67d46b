"""Package names imported on first use (PEP 562): a package's `__init__` maps each name it exports to its
submodule, so importing one submodule does not import the others (and torch with them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str | None]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `name` is the attribute of that name in `package.<exports[name]>`,
    or the submodule `package.<name>` itself where `exports[name]` is None."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{exports[name] or name}")
        return module if exports[name] is None else getattr(module, name)

    return __getattr__
