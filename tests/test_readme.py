"""The README and the reference pages it leads to (docs/cli.md, configuration.md, environments.md,
running.md, chat.md) say only what works: every command in their shell blocks (and every `k3rl ...` or
`make ...` quoted in their prose) is checked, and every repository file and link they name exists.

How a command is checked, cheaply: `k3rl` commands are parsed by the real CLI (options, arguments and
their types); the quick ones run for real (`config show`, `envs list|check`, `runs`); `k3rl train`'s
config is loaded with its overrides and goes through the checks the job makes before Ray starts (env
ids, preflight: checkpoint, oracle, context). `make T` must be a target (`make -n T`); any other program
(pip, ray) must answer `--help` for its subcommand.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from k3rl.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in ("cli", "configuration", "environments",
                                                                         "running", "chat"))]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
RUN_FOR_REAL = {("config", "show"), ("envs", "list"), ("envs", "check"), ("runs",)}
ENV_ID = re.compile(r"^[\w.]+/[\w.-]+-v\d+$")  # a Gymnasium id (k3rl/KeyLookup-v0), not a file


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(), re.S | re.M)


def prose(page: Path) -> str:
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def commands(page: Path) -> list[list[str]]:
    """The commands of the page's bash blocks (variables set in a block expanded), and the `k3rl ...` and
    `make ...` commands quoted in its prose (marked by a leading "mention": a name, maybe not all its
    arguments)."""
    out = []
    for lang, text in code_blocks(page):
        if lang != "bash":
            continue
        env: dict[str, str] = {}
        for line in text.splitlines():
            line = re.sub(r"\$(\w+)", lambda m, env=env: env.get(m.group(1), m.group(0)), line)
            words = shlex.split(line, comments=True)
            if len(words) == 1 and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
                env.update([words[0].split("=", 1)])
            elif words:
                out.append(words)
    for quoted in re.findall(r"`((?:k3rl|make) [^`]+)`", prose(page)):
        if not re.search(r"[<>]|\.\.\.|\b[A-Z]+\b", quoted):  # with a placeholder (NAME, N): not a command to run
            out.append(["mention", *shlex.split(quoted)])
    return out


def every_command() -> list[tuple[str, list[str]]]:
    found: dict[str, tuple[str, list[str]]] = {}
    for page in PAGES:
        for words in commands(page):
            for part in _split_nested(words):
                found.setdefault(" ".join(part), (page.name, part))
    return sorted(found.values(), key=lambda x: " ".join(x[1]))


def _split_nested(words: list[str]) -> list[list[str]]:
    """`ray job submit ... -- k3rl train X`: the outer command, and the one it runs."""
    if "--" in words:
        i = words.index("--")
        return [words[:i], words[i + 1:]]
    return [words]


@pytest.mark.parametrize("page,words", every_command(), ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_the_command_works(page, words, tmp_path):
    mention = words[0] == "mention"
    program, args = words[mention], words[mention + 1:]
    if program == "k3rl":
        check_k3rl(args, mention, tmp_path)
    elif program == "make":
        done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{page}: make {' '.join(args)}: {done.stderr}"
    elif program == "python":  # a script or a module of the repository: it must answer --help
        target = args[:2] if args[0] == "-m" else args[:1]
        done = subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, f"{page}: {' '.join(words)}: {done.stderr[-500:]}"
    else:
        sub = [a for a in args[:2] if re.fullmatch(r"[a-z]+", a)]  # `pip install .` -> pip install --help
        exe = Path(sys.executable).with_name(program)
        done = subprocess.run([str(exe) if exe.exists() else program, *sub, "--help"], capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, f"{page}: {' '.join(words)}: {done.stderr[-500:]}"
    for word in args:  # the repository files a command names
        for path in re.findall(r"[\w./-]+", word):
            if is_repo_path(path):
                assert (ROOT / path).exists(), f"{page}: {' '.join(words)} names {path}, which does not exist"


def check_k3rl(args: list[str], mention: bool = False, out: Path | None = None) -> None:
    """Parse `args` with the real CLI; run the quick commands (on local stores only: a test sends nothing
    beyond loopback); check a train command's config as the job would. A mention need only name a command."""
    cmd, names, rest = typer.main.get_command(app), [], list(args)
    while hasattr(cmd, "get_command") and rest and not rest[0].startswith("-"):  # a group (typer's own click)
        cmd, names = cmd.get_command(cmd.context_class(cmd), rest[0]), [*names, rest.pop(0)]
        assert cmd is not None, f"k3rl has no command {' '.join(names)}"
    if mention and not rest:
        return
    if "--help" in rest or tuple(names) in RUN_FOR_REAL and not any("://" in a for a in rest):
        if out is not None:  # what a command saves goes to the test's folder, not into the checkout
            args = [str(out / a) if i and args[i - 1] == "--save" else a for i, a in enumerate(args)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, f"k3rl {' '.join(args)}: {result.output}"
        return
    parsed = cmd.make_context(" ".join(names), list(rest))  # raises on an unknown option, a bad value, a missing argument
    if names == ["train"]:
        check_train(str(parsed.params["config"]) if parsed.params["config"] else None, tuple(parsed.params["set_"] or ()))


@functools.cache
def check_train(config: str | None, overrides: tuple[str, ...]) -> None:
    from k3rl.config import JobConfig
    from k3rl.envs.registration import check_env_ids
    from k3rl.rollout.job_start import preflight

    cfg = JobConfig.load(ROOT / config if config else None, list(overrides))
    check_env_ids(cfg)
    preflight(cfg)


def is_repo_path(token: str) -> bool:
    """A path into the repository (a top-level file or something under a top-level folder), not an env id,
    a glob or a placeholder."""
    token = token.rstrip(".,:;")
    if not token or ENV_ID.match(token) or any(c in token for c in "*<>$") or token.startswith(("runs/", "/")):
        return False
    return token in TOP or token.split("/")[0] in TOP and "/" in token


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_and_link_it_names_exists(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # markdown links
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        assert where.exists(), f"{page.name} links {target}: no such file"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{page.name} links {target}: no heading #{anchor} in {where.name}"
    for token in re.findall(r"`([^`\s]+)`", prose(page)):  # files named in the prose
        if is_repo_path(token):
            assert (ROOT / token.rstrip(".,:;")).exists(), f"{page.name} names `{token}`, which does not exist"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", prose(page), re.M)}


def test_the_readme_leads_with_the_first_hour():
    """What a newcomer reads first: what k3rl is, how to install it, the two commands, their own environment."""
    text = (ROOT / "README.md").read_text()
    heads = re.findall(r"^## (.+)$", prose(ROOT / "README.md"), re.M)
    assert heads[:7] == ["Contents", "Install", "Quick start", "Train your own environment", "Train your own agent",
                         "Run on a cluster", "The run folder"]
    intro = text.split("## Contents")[0].strip().splitlines()
    assert len(intro) <= 7  # the title, and what k3rl is in about 5 lines
    quick = text.split("## Quick start")[1].split("## Train your own environment")[0]
    assert "make demo" in quick and "make test" in quick and len(quick.splitlines()) < 45
    assert "Agentic workloads: vision, code, long horizon" in text
    assert "make test-fast" in text and "make test " in text
