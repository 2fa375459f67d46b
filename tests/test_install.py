"""The package as it ships: the wheel built from the repository holds every file of the folders that
pyproject.toml maps into `k3rl.*` (each module, and the data the code reads: the sandbox's Dockerfile
and host_setup.sh, the chart targets, the examples and their warm start, ...) and nothing else, and it
imports and runs from its own files. `make wheel-check` (run by .ci/run) goes further: the wheel installed
with its dependencies in a fresh venv, the CLI run and every module imported from outside the repository.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def repository_files() -> list[str]:
    """The files git tracks (a checkout's own files, untracked scratch left out); outside a git
    checkout (an unpacked sdist), every file but caches and build output."""
    run = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if run.returncode == 0 and run.stdout:
        return [f for f in run.stdout.decode().split("\0") if f and (ROOT / f).is_file()]
    skip = ("__pycache__", ".egg-info", ".git", ".venv", "build", "dist")
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and p.suffix != ".pyc" and not any(part.endswith(skip) for part in p.relative_to(ROOT).parts)]


def expected_wheel_files(files: list[str]) -> dict[str, str]:
    """Wheel path -> repository path of every file under a folder mapped into `k3rl.*`."""
    return {f"{name.replace('.', '/')}/{Path(f).relative_to(folder).as_posix()}": f
            for name, folder in PACKAGE_DIR.items() for f in files if Path(f).is_relative_to(folder)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built once from a copy of the repository's files (a build in the checkout leaves a
    build/ folder whose stale files the next wheel would carry)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for f in repository_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # the venv's setuptools when it has one (no download), else pip's isolated build fetches it
    isolation = ["--no-build-isolation"] if find_spec("setuptools") else []
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp / "dist"),
                          str(src)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    (built,) = (tmp / "dist").glob("k3rl-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_package_folders_and_nothing_else(wheel):
    expected = expected_wheel_files(repository_files())
    assert {"k3rl/sandboxes/Dockerfile", "k3rl/sandboxes/host_setup.sh", "k3rl/envs/chart_match_targets.json",
            "k3rl/examples/demo.yaml", "k3rl/examples/keylookup_warm_start/config.json",
            "k3rl/rollout/transport/__init__.py", "k3rl/model/lora.py"} <= set(expected)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    missing = sorted(set(expected) - shipped)
    extra = sorted(shipped - set(expected))
    assert not missing, (f"the wheel leaves out {len(missing)} file(s) of the package folders (a subfolder without "
                         f"__init__.py, or a file type pyproject.toml's package-data does not name): "
                         + ", ".join(expected[m] for m in missing[:20]))
    assert not extra, f"the wheel holds files the repository does not: {extra[:20]}"
    with zipfile.ZipFile(wheel) as z:
        for path, source in expected.items():  # byte for byte (a stale build copy would differ)
            assert z.read(path) == (ROOT / source).read_bytes(), f"{path} in the wheel differs from {source}"


def _defines(source: str, attr: str) -> bool:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == attr for a in node.names):
            return True
    return False


def test_every_entry_point_of_the_wheel_names_a_module_and_a_name_it_defines(wheel):
    with zipfile.ZipFile(wheel) as z:
        (ep_file,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str
        entry_points.read_string(z.read(ep_file).decode())
        assert entry_points["console_scripts"]["k3rl"].strip() == "k3rl.cli:app"
        names = set(z.namelist())
        for group in entry_points.sections():
            for key, value in entry_points[group].items():
                module, _, attr = value.strip().partition(":")
                path = module.replace(".", "/")
                found = [p for p in (f"{path}.py", f"{path}/__init__.py") if p in names]
                assert found, f"entry point {group}:{key} = {value}: the wheel has no module {module}"
                assert _defines(z.read(found[0]).decode(), attr), \
                    f"entry point {group}:{key} = {value}: {found[0]} defines no {attr}"


def test_the_unpacked_wheel_imports_and_finds_its_examples_outside_the_repository(wheel, tmp_path):
    """The wheel's own files on the path (ahead of the editable install), from a directory outside the
    repository: the package, its CLI and the examples' files resolve inside the unpacked wheel."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import json, k3rl, k3rl.cli, k3rl.examples as e, k3rl.sandboxes.cli, k3rl.envs_cli\n"
             "print(json.dumps([k3rl.__file__, k3rl.sandboxes.cli.__file__, str(e.path('demo.yaml')),"
             " str(e.path('keylookup_warm_start'))]))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr[-3000:]
    for path in json.loads(run.stdout.strip().splitlines()[-1]):
        assert Path(path).resolve().is_relative_to(site.resolve()), f"{path} is not the wheel's"


def test_a_config_named_but_not_here_is_the_installed_example(tmp_path, monkeypatch, capsys):
    """`k3rl train demo.yaml` (here `config show`) from any directory: the example installed with k3rl, its
    warm start read beside it; a file of that name here wins; a name that is neither is refused with the
    examples' names."""
    import typer

    import k3rl.examples
    from k3rl.cli import _config_path

    run = subprocess.run([sys.executable, "-m", "k3rl.cli", "config", "show", "demo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert f"the example installed with k3rl, {k3rl.examples.path('demo.yaml')}" in " ".join(run.stderr.split())
    assert f"checkpoint: {k3rl.examples.path('keylookup_warm_start')}" in run.stdout

    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo.yaml").write_text("learner:\n  steps: 3\n")
    assert _config_path(Path("demo.yaml")) == Path("demo.yaml")  # a file here wins
    assert _config_path(Path("sub/demo.yaml")) == Path("sub/demo.yaml")  # a path is the user's: JobConfig refuses it
    assert _config_path(None) is None
    capsys.readouterr()
    with pytest.raises(typer.Exit) as exit_:
        _config_path(Path("dmeo.yaml"))
    assert exit_.value.exit_code == 2
    jobs = ", ".join(sorted(p.name for p in k3rl.examples.HERE.glob("*.yaml")))
    assert "demo.yaml" in jobs
    assert f"config file dmeo.yaml does not exist, nor is it an example installed with k3rl ({jobs})" \
        in " ".join(capsys.readouterr().err.split())
