"""The package list, derived: every folder with an `__init__.py` under the top-level folders that
pyproject.toml's `[tool.setuptools.package-dir]` maps into the `k3rl.*` namespace (so a new
subpackage can never be left out of the wheel). Everything else is in pyproject.toml."""

import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def derived_packages() -> list[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]))
    return sorted(found)


setup(packages=derived_packages())
