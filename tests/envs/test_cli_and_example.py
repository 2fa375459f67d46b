"""`k3rl envs list|check` and the custom-environment example."""

import importlib.util
import io
import re
from pathlib import Path

import gymnasium as gym
from gymnasium.utils.env_checker import check_env
from rich.console import Console
from typer.testing import CliRunner

from k3rl.cli import app
from k3rl.envs.builtin import BUILTIN_ENVS
from k3rl.envs_cli import check_env_command, list_envs
from k3rl.rollout.episode import run_oracle_episode

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_env.py"


def console():
    return Console(file=io.StringIO(), width=200, color_system=None)


def test_list_shows_every_builtin():
    c = console()
    ids = list_envs(c)
    out = c.file.getvalue()
    assert set(BUILTIN_ENVS) <= set(ids)
    for env_id in BUILTIN_ENVS:
        assert env_id in out
    assert "bash, read_file, write_file, str_replace, run_tests" in out
    # an MCP env's tools come from its server, started in the sandbox at reset: the list shows those it declares
    assert "list_files (MCP), read_file (MCP), view_image (MCP)" in out


def test_check_prints_the_oracle_transcript():
    c = console()
    assert check_env_command("k3rl/KeyLookup-v0", seed=3, console=c) == 0
    out = c.file.getvalue()
    env = gym.make("k3rl/KeyLookup-v0").unwrapped
    env.reset(seed=3)
    assert "env checker passed" in out and env.history[0].content in out
    assert f"-> lookup(key='{env.task.key}')" in out and f"\n  {env.task.value}\n" in out
    assert "reward 1.0000, 2 turns, terminated" in out


def test_check_unknown_id_exits_2():
    c = console()
    assert check_env_command("k3rl/Nope-v0", console=c) == 2
    assert "no environment 'k3rl/Nope-v0' is registered; known: k3rl/Agent-v0, k3rl/ChartMatch-v0" in c.file.getvalue()


def test_cli_commands():
    runner = CliRunner()
    result = runner.invoke(app, ["envs", "check", "k3rl/KeyLookup-v0", "--seed", "1"])
    assert result.exit_code == 0 and "reward 1.0000" in result.output
    result = runner.invoke(app, ["envs", "list"])
    assert result.exit_code == 0 and "KeyLookup" in result.output


def test_custom_env_example():
    assert len(EXAMPLE.read_text().splitlines()) < 50
    spec = importlib.util.spec_from_file_location("custom_env_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = gym.make("examples/Units-v0")
    check_env(env.unwrapped)
    for seed in range(8):
        assert run_oracle_episode(env, seed=seed).reward == 1.0
    base = env.unwrapped
    base.reset(seed=0)
    obs, *_ = base.step(base.say(tool_calls=[{"name": "convert", "arguments": {"value": 1, "src": "m", "dst": "km"}}]))
    assert obs[0]["content"].startswith("Error: cannot convert m to km")
    assert base.tools[0]["function"]["parameters"]["required"] == ["value", "src", "dst"]


def test_the_readme_env_runs_as_written():
    """The code block of README.md's "Train your own environment", executed as is, then `k3rl envs check` on it."""
    section = ROOT.joinpath("README.md").read_text().split("## Train your own environment", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
        result = CliRunner().invoke(app, ["envs", "check", "mypkg/Echo-v0", "--seed", "5"])
        assert result.exit_code == 0, result.output
        out = result.output
        assert "env checker passed" in out and "-> shout(text=" in out and "reward 1.0000, 2 turns, terminated" in out
    finally:
        gym.registry.pop("mypkg/Echo-v0", None)


def test_check_reports_an_env_without_an_oracle():
    from k3rl.envs import ToolEnv
    from k3rl.envs.key_lookup import KeyLookupEnv

    class Plain(KeyLookupEnv):
        oracle = ToolEnv.oracle  # no scripted policy

    gym.register("k3rltest/PlainNoOracle-v0", entry_point=Plain)
    try:
        c = console()
        assert check_env_command("k3rltest/PlainNoOracle-v0", console=c) == 1
        assert "oracle episode failed at generate: NoOracleError: Plain defines no scripted oracle" in c.file.getvalue()
    finally:
        gym.registry.pop("k3rltest/PlainNoOracle-v0", None)
