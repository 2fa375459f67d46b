"""PythonTool, CodeFix and ChartMatch against the real sandbox backend (Docker, else bubblewrap)."""

import io

import gymnasium as gym
import pytest
from PIL import Image

import k3rl.envs  # noqa: F401
from k3rl.envs.chart_match import HEIGHT, WIDTH, chart_task, load_targets
from k3rl.envs.code_fix_tasks import BUGS
from k3rl.envs.python_tool import FAMILIES, last_integer
from k3rl.images import PNG_MAGIC, png_size
from k3rl.rollout.episode import run_oracle_episode

from .conftest import BACKEND


def make(env_id, **kw):
    return gym.make(env_id, sandbox_backend=BACKEND, **kw)


# -- PythonTool ------------------------------------------------------------------------------
def test_python_tool_oracle_runs_code_in_the_sandbox(require_sandbox):
    require_sandbox()
    env = make("k3rl/PythonTool-v0")
    for seed, family in [(0, "digit_sum"), (1, "savings")]:
        ep = run_oracle_episode(env, seed=seed, options={"family": family})
        assert ep.reward == 1.0 and ep.terminated
        tool_msg = next(m for m in ep.turns if m.role == "tool")
        assert last_integer(tool_msg.text) == env.unwrapped.task.answer  # printed by the sandboxed program
    assert not env.unwrapped.has_sandbox  # released when the episode ended


def test_python_tool_reports_errors_and_timeouts(require_sandbox):
    require_sandbox()
    env = make("k3rl/PythonTool-v0", exec_timeout_s=2).unwrapped
    env.reset(seed=3)

    def run(code):
        return env.step(env.say(tool_calls=[{"name": "python", "arguments": {"code": code}}]))[0][0]["content"]

    out = run("print(1/0)")
    assert "ZeroDivisionError" in out and out.endswith("[exit code 1]")
    assert run("import time\ntime.sleep(30)") == "[timed out after 2s and was killed]"
    assert run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)").endswith("[exit code 1]")
    env.close()


def test_python_task_answers_are_exact():
    import numpy as np

    for name, maker in FAMILIES.items():
        task = maker(np.random.default_rng(0))
        scope = {}
        out = io.StringIO()
        import contextlib

        with contextlib.redirect_stdout(out):
            exec(task.code, scope)  # the oracle's program (trusted, generated here) prints the answer
        assert int(out.getvalue().strip()) == task.answer, name
    assert last_integer("so the total is 1,234,567.") == 1234567 and last_integer("none") is None


# -- CodeFix ---------------------------------------------------------------------------------
def test_every_bug_fails_its_tests_and_the_fix_passes_them(tmp_path):
    """Host-side check of the catalogue (the same files the sandbox gets): buggy -> fail, fixed -> pass."""
    import subprocess
    import sys

    import numpy as np

    for state in ("buggy", "fixed"):
        for name, maker in BUGS.items():
            task = maker(np.random.default_rng(1))
            root = tmp_path / state / name
            for path, content in task.files.items():
                if state == "fixed" and path == task.module:
                    assert content.count(task.fix[0]) == 1
                    content = content.replace(*task.fix)
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_text(content)
            (root / "hidden").mkdir()
            (root / "hidden" / f"test_hidden_{name}.py").write_text(task.hidden_tests.replace('"/work"', repr(str(root))))
            (root / "tests" / "__init__.py").write_text("")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                               "-rA", str(tmp_path / state)], capture_output=True, text=True, timeout=120)
        passed = proc.stdout.count("PASSED ")
        failed = proc.stdout.count("FAILED ")
        if state == "buggy":
            assert (passed, failed) == (0, 2 * len(BUGS)), proc.stdout[-3000:]
        else:
            assert (passed, failed) == (2 * len(BUGS), 0), proc.stdout[-3000:]


def test_code_fix_oracle_fixes_the_bug(require_sandbox):
    require_sandbox("pytest")
    env = make("k3rl/CodeFix-v0")
    for bug in ("binary_search_loop", "fizzbuzz_order"):
        ep = run_oracle_episode(env, seed=2, options={"bug": bug})
        assert ep.reward == 1.0, env.unwrapped.last_hidden_output
        tests_out = [m.text for m in ep.turns if m.tool_name == "run_tests"][-1]
        assert "1 passed" in tests_out
        assert [m.tool_name for m in ep.turns if m.role == "tool"] == ["read_file", "str_replace", "run_tests"]


def test_code_fix_tools_and_grading(require_sandbox):
    require_sandbox("pytest")
    env = make("k3rl/CodeFix-v0").unwrapped
    env.reset(seed=4, options={"bug": "clamp_bound"})

    def act(name, **arguments):
        return env.step(env.say(tool_calls=[{"name": name, "arguments": arguments}]))

    assert "1 failed" in act("run_tests")[0][0]["content"]
    assert act("read_file", path="../etc/passwd")[0][0]["content"].startswith("Error: path '../etc/passwd' resolves")
    assert act("read_file", path="nope.py")[0][0]["content"].startswith("Error:")
    assert "occurs 0 times" in act("str_replace", path="bounds.py", old="not there", new="x")[0][0]["content"]
    # reward hacking: make the visible tests pass by rewriting them, plant a conftest that skips everything
    act("write_file", path="tests/test_bounds.py", content="def test_ok():\n    assert True\n")
    act("write_file", path="conftest.py", content="import pytest\ndef pytest_collection_modifyitems(items):\n"
                                                  "    for i in items:\n        i.add_marker(pytest.mark.skip)\n")
    assert "1 skipped" in act("bash", command="python3 -m pytest -q -p no:cacheprovider tests")[0][0]["content"]
    obs, reward, term, _, _ = env.step("All tests pass now.")
    assert term and reward == 0.0  # the hidden tests still run the real contract
    assert "failed" in env.last_hidden_output


def test_code_fix_judges_in_a_fresh_sandbox_where_the_agents_processes_do_not_run(require_sandbox):
    """A daemon the agent leaves running in its sandbox rewrites any hidden tests the moment they land there;
    the judge's sandbox holds the agent's files but none of its processes, so the unfixed bug still fails."""
    require_sandbox("pytest")
    env = make("k3rl/CodeFix-v0").unwrapped
    env.reset(seed=4, options={"bug": "clamp_bound"})
    daemon = ("nohup sh -c 'while true; do for d in .k3rl-hidden-*; do [ -d \"$d\" ] && "
              "printf \"def test_ok():\\n    assert True\\n\" > \"$d/test_hidden.py\"; done; sleep 0.005; done' "
              ">/dev/null 2>&1 &")
    env.step(env.say(tool_calls=[{"name": "bash", "arguments": {"command": daemon}}]))
    assert "sleep 0.005" in env.sandbox.exec("ps -eo args").stdout  # it runs in the episode's sandbox
    obs, reward, term, _, _ = env.step("Fixed.")
    assert term and reward == 0.0, env.last_hidden_output
    assert "failed" in env.last_hidden_output


# -- ChartMatch ------------------------------------------------------------------------------
def test_chart_match_oracle_sees_images_and_scores_one(require_sandbox):
    require_sandbox("matplotlib")
    env = make("k3rl/ChartMatch-v0")
    obs, info = env.reset(seed=0)
    target = obs[0]["images"][0]
    assert target.startswith(PNG_MAGIC) and png_size(target) == (WIDTH, HEIGHT)
    obs, reward, term, trunc, info = env.step(env.unwrapped.oracle())
    assert obs in env.observation_space
    render = obs[0]["images"][0]
    assert obs[0]["role"] == "tool" and obs[0]["tool_name"] == "render" and png_size(render) == (WIDTH, HEIGHT)
    assert Image.open(io.BytesIO(render)).getbbox() is not None
    obs, reward, term, trunc, info = env.step(env.unwrapped.oracle())
    assert term and reward == pytest.approx(1.0, abs=1e-9)
    assert len(env.unwrapped.transcript().split("[image 256x192]")) == 3  # target + render


def test_chart_match_partial_credit_svg_and_errors(require_sandbox):
    require_sandbox("matplotlib")
    env = make("k3rl/ChartMatch-v0").unwrapped
    env.reset(seed=0, options={"task_index": 0})
    task = env.task

    def render(code, language="matplotlib"):
        return env.step(env.say(tool_calls=[{"name": "render", "arguments": {"code": code, "language": language}}]))[0][0]

    bad = render("fig, ax = plt.subplots()\nax.bar(")
    assert bad["content"].startswith("Error:") and "SyntaxError" in bad["content"] and bad["images"] == []
    wrong_color = task.code.replace(task.color, "tab:gray" if task.color != "tab:gray" else "black")
    assert render(wrong_color)["images"]
    svg = render(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}">'
                 '<rect x="40" y="20" width="60" height="150" fill="purple"/></svg>', "svg")
    assert png_size(svg["images"][0]) == (WIDTH, HEIGHT)
    _, reward, term, _, _ = env.step("done")
    assert term and 0.0 <= reward < 0.9  # the last render (a single SVG bar) is only partly similar


def test_shipped_targets_cover_the_task_set():
    targets = load_targets()
    assert sorted(targets) == list(range(len(targets))) and len(targets) == 32
    kinds = {chart_task(i).kind for i in targets}
    assert kinds == {"bar", "barh", "line", "scatter", "step"}
