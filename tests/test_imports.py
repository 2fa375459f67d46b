"""Dependencies point one way (docs/architecture.md): the driver -> rollout, learner, envs -> sandboxes;
rollout, learner -> k3rl.model -> kernels; k3rl's shared modules (types, config, chat, ...) below them all.

Read from the source with `ast`: every import statement of every module of the package, at its top or
inside a function, relative ones resolved. The nodes are the folders (envs, rollout, learner, kernels,
sandboxes, examples), k3rl/model ("model"), and each other module of k3rl/ on its own: that folder holds
both the driver (top) and the shared modules (bottom), so as one node the driver's `k3rl.job ->
k3rl.rollout` and the rollout's `-> k3rl.types` would read as a cycle.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = ("envs", "rollout", "learner", "kernels", "sandboxes", "examples")
# the modules of k3rl/ that drive the others (commands, the job); nothing below them may import them
DRIVER = {"k3rl.cli", "k3rl.job", "k3rl.replay", "k3rl.envs_cli", "k3rl.reexecute", "k3rl.runs", "k3rl.step_view",
          "k3rl.compare"}
TRANSPORT = "k3rl.rollout.transport"  # the weight transport: its send half runs in the learner, by design
# what each kind of node may import besides itself ("shared": k3rl's modules but the driver's), and why
RULES: dict[str, tuple[set[str], str]] = {
    "kernels": (set(), "kernels imports nothing of the project"),
    "model": ({"kernels", "shared"}, "the model stands on kernels and k3rl's shared modules only"),
    "sandboxes": ({"shared"}, "sandboxes imports nothing of the project but k3rl's shared modules"),
    "envs": ({"sandboxes", "shared"}, "envs stands on sandboxes and k3rl's shared modules"),
    "rollout": ({"envs", "sandboxes", "model", "kernels", "shared"},
                "rollout stands on envs, sandboxes, the model, kernels and k3rl's shared modules, never the learner"),
    "learner": ({"model", "kernels", "shared", TRANSPORT},
                f"the learner stands on the model, kernels and k3rl's shared modules; of rollout it imports only "
                f"the weight transport's send half, {TRANSPORT}"),
    "shared": ({"shared", "model", "kernels"},
               "k3rl's shared modules sit below rollout, learner, envs and sandboxes (the config may validate "
               "against the model); only the driver (" + ", ".join(sorted(DRIVER)) + ") imports those"),
    "examples": ({"envs", "rollout", "learner", "model", "kernels", "sandboxes", "shared"},
                 "the examples are user code: anything but the driver"),
    "driver": ({"driver", "envs", "rollout", "learner", "model", "kernels", "sandboxes", "shared", "examples"}, ""),
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module: of the project (the longest dotted prefix that is a module), or another's
    where: str  # "path:line" of the import statement
    at_load: bool  # runs when the module loads (not inside a function, not under TYPE_CHECKING)
    in_function: bool = False
    reason: bool = False  # a comment says why it is where it is (on its line or the line(s) above)

    @property
    def project(self) -> bool:
        return self.target.split(".")[0] == "k3rl"


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the folders pyproject.toml maps into `k3rl.*`."""
    out = {}
    for name, folder in PACKAGE_DIR.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [name, *path.relative_to(root / folder).with_suffix("").parts]
            out.setdefault(".".join(parts[:-1] if parts[-1] == "__init__" else parts), path)
    return out


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A comment (more than a `noqa`) on the statement's line, or above it past the imports of its run
    (its own line, or the end of the `try:` / `if ...:` that opens the block)."""
    if re.sub(r"^\s*noqa(:\s*[A-Z0-9, ]+)?", "", lines[lineno - 1].partition("#")[2]).strip():
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    return i >= 0 and (lines[i].strip().startswith("#") or re.search(r":\s*#", lines[i]) is not None)


def module_edges(name: str, path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    """Every import statement of one module, anywhere in it."""
    text = path.read_text()
    lines = text.splitlines()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = []

    def visit(node: ast.AST, at_load: bool, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, True)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False, in_function)
                continue
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # from .x import y: x relative to the package, one level up per extra dot
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" for a in child.names]
            else:
                visit(child, at_load, in_function)
                continue
            where = f"{path.relative_to(root)}:{child.lineno}"
            for t in targets:
                target = (_resolve(t, modules) or t) if t.split(".")[0] == "k3rl" else t
                if target != name:
                    edges.append(Edge(name, target, where, at_load, in_function, _has_reason(lines, child.lineno)))

    visit(ast.parse(text), True, False)
    return edges


def import_edges(modules: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    return [e for name, path in modules.items() for e in module_edges(name, path, modules, root)]


def node(module: str) -> str:
    """The folder a module belongs to, "model", or (the rest of k3rl/) the module itself."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "model":
        return "model"
    if len(parts) > 1 and parts[1] in FOLDERS:
        return parts[1]
    return ".".join(parts[:2])


def kind(module: str) -> str:
    n = node(module)
    if n in DRIVER:
        return "driver"
    return "shared" if n.startswith("k3rl") else n


def violations(edges: list[Edge]) -> list[str]:
    out = []
    for e in filter(lambda e: e.project, edges):
        src, dst = kind(e.source), kind(e.target)
        allowed, why = RULES[src]
        if node(e.source) == node(e.target) or dst in allowed:
            continue
        if TRANSPORT in allowed and (e.target == TRANSPORT or e.target.startswith(TRANSPORT + ".")):
            continue
        out.append(f"{e.where} imports {e.target}: {why}")
    return out


def cycles(edges: list[Edge], key=node) -> list[list[str]]:
    """Each strongly connected set of >1 nodes of the graph `key(source) -> key(target)`, as one cycle
    through it: ["a -> b (path:line)", "b -> a (path:line)"]."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for e in filter(lambda e: e.project, edges):
        a, b = key(e.source), key(e.target)
        if a != b:
            graph[a].setdefault(b, e.where)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in list(graph):
        if v not in index:
            connect(v)
    out = []
    for component in found:  # one cycle through the component: breadth-first from its first node back to it
        start = min(component)
        parent: dict[str, str] = {}
        frontier, end = [start], None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in graph[v]:
                    if w == start:
                        end = v
                        break
                    if w in component and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(parent[path[-1]])
        path.reverse()
        out.append([f"{a} -> {b} ({graph[a][b]})" for a, b in zip(path, [*path[1:], start], strict=True)])
    return out


MODULES = project_modules()
EDGES = import_edges(MODULES)


def test_the_source_has_the_modules_and_imports_this_test_reads():
    assert {"k3rl.cli", "k3rl.model.model", "k3rl.rollout.engine", "k3rl.learner.trainer", "k3rl.kernels.kda",
            "k3rl.sandboxes.base", "k3rl.envs.base", "k3rl.examples"} <= set(MODULES)
    assert any(e.source == "k3rl.learner.actor" and e.target == TRANSPORT for e in EDGES)
    assert any(e.in_function and e.project for e in EDGES)  # function-level imports are read too
    assert any(e.target == "torch" for e in EDGES) and not any(e.target.startswith(".") for e in EDGES)


def test_every_import_points_down_the_layers():
    bad = violations(EDGES)
    assert not bad, "imports against the layers (docs/architecture.md):\n  " + "\n  ".join(bad)


def test_no_import_cycle_between_the_folders():
    found = cycles(EDGES)
    assert not found, "import cycles between the folders (function-level imports count too):\n  " + \
        "\n  ".join(" ; ".join(c) for c in found)


def test_no_module_imports_itself_back_while_it_loads():
    """Module by module, the imports that run at load time form no cycle, so any module can be imported
    first and none needs a function-level import to break a loop."""
    found = cycles([e for e in EDGES if e.at_load], key=lambda m: m)
    assert not found, "modules that import each other at load time:\n  " + "\n  ".join(" ; ".join(c) for c in found)


def test_every_function_level_import_says_why():
    """What stays inside a function breaks a real cost (an optional dependency, seconds of start-up) and a
    comment beside it says which; everything else is imported at the top of its module."""
    silent = sorted({e.where for e in EDGES if e.in_function and not e.reason})
    assert not silent, ("function-level imports without a comment saying why (move them to the top of the "
                        "module, or say what they save):\n  " + "\n  ".join(silent))


def test_the_checks_catch_an_edge_against_the_layers():
    """The checks above on the real edges plus one from rollout to the learner: both name its file and line."""
    extra = Edge("k3rl.rollout.worker", "k3rl.learner.trainer", "rollout/worker.py:99", False)
    assert violations([*EDGES, extra]) == [f"rollout/worker.py:99 imports k3rl.learner.trainer: {RULES['rollout'][1]}"]
    (cycle,) = cycles([*EDGES, extra])
    assert any("rollout -> learner (rollout/worker.py:99)" == step for step in cycle)
    assert any(step.startswith("learner -> rollout (learner/") for step in cycle), cycle
    inverted = Edge("k3rl.kernels.kda", "k3rl.model.model", "kernels/kda/__init__.py:1", True, False)
    assert violations([inverted]) == [f"kernels/kda/__init__.py:1 imports k3rl.model.model: {RULES['kernels'][1]}"]
    loop = [Edge("k3rl.types", "k3rl.images", "k3rl/types.py:1", True, False),
            Edge("k3rl.images", "k3rl.types", "k3rl/images.py:2", True, False)]
    assert cycles(loop, key=lambda m: m) == [["k3rl.images -> k3rl.types (k3rl/images.py:2)",
                                              "k3rl.types -> k3rl.images (k3rl/types.py:1)"]]


def test_the_command_line_starts_without_torch_ray_or_mlflow(tmp_path):
    """`k3rl --help` and `k3rl config show` load none of the libraries that take seconds to import."""
    probe = "import sys, k3rl.cli; print(sorted(m for m in ('torch', 'ray', 'mlflow') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_actors_that_need_no_model_import_no_torch(tmp_path):
    """A rollout worker and the trajectory buffer (Ray actors of every job) validate the job's config, build
    its chat template and step its envs without torch or the model (about 1-2 s of each actor's start); the
    model's package imports no torch._dynamo (about 1 s of every process that imports it)."""
    probe = ("import sys\n"
             "from k3rl.config import JobConfig\n"
             "import k3rl.rollout.worker, k3rl.rollout.buffer\n"
             "from k3rl.rollout.episode import EpisodeSpec, make_env, make_template\n"
             "cfg = JobConfig.load('examples/agent.yaml', ['sandbox.backend=none'])\n"
             "template = make_template(cfg)\n"
             "for e in cfg.envs.train:\n"
             "    make_env(EpisodeSpec(id='x', env_id=e.id, seed=1, group_id='g', env_kwargs=e.kwargs), cfg,\n"
             "             template).reset(seed=1)\n"
             "print(sorted(m for m in ('torch', 'k3rl.model.model') if m in sys.modules))\n"
             "import k3rl.model, k3rl.rollout.engine, k3rl.learner.actor\n"
             "k3rl.model.K3ForCausalLM, k3rl.rollout.engine.EmbeddedEngine\n"
             "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-2:] == ["[]", "[]"], run.stdout
