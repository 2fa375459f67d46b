"""Registration: every registered tool env passes Gymnasium's checker; the entry-point group loads plugins."""

import sys
import textwrap
import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import k3rl.envs
from k3rl.envs.builtin import BUILTIN_ENVS, register_all
from k3rl.envs_cli import tool_env_ids

from .conftest import BACKEND


def test_builtins_are_registered_idempotently():
    assert set(BUILTIN_ENVS) <= set(gym.registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-registering would warn "Overriding environment"
        register_all()
        k3rl.envs.register_all()
    assert gym.spec("k3rl/CodeFix-v0").entry_point == "k3rl.envs.code_fix:CodeFixEnv"


@pytest.mark.parametrize("env_id", sorted(set(BUILTIN_ENVS) - {"k3rl/Agent-v0"}))  # its agent drives it, not step()
def test_env_checker_passes(env_id, require_sandbox):
    if env_id == "k3rl/CodeFix-v0":  # its random-text final answers run the hidden tests in a sandbox
        require_sandbox("pytest")
    env = gym.make(env_id, sandbox_backend=BACKEND)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    env.close()
    assert [str(w.message) for w in caught if "gymnasium" in str(w.filename)] == []


def test_the_agent_env_makes_and_resets_by_its_registered_id():
    loop = "k3rl.examples.agents.openai_loop"
    env = gym.make("k3rl/Agent-v0", agent=f"{loop}:solve", tasks=f"{loop}:task")
    obs, info = env.reset(seed=1)
    assert env.unwrapped.is_agent_env and info["task_id"] == "lookup-1" and obs.startswith("{")
    env.close()


def test_entry_point_group_registers_a_third_party_env(tmp_path, monkeypatch):
    # a real installed distribution (a dist-info on sys.path) declaring the k3rl.envs group
    pkg = tmp_path / "k3rl_plugin_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import gymnasium as gym

        def register():
            gym.register("plugin/Echo-v0", entry_point="k3rl.envs.key_lookup:KeyLookupEnv", kwargs={"num_keys": 2})

        def broken():
            raise RuntimeError("plugin bug")
    """))
    dist = tmp_path / "k3rl_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: k3rl-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[k3rl.envs]\ndemo = k3rl_plugin_demo:register\nbroken = k3rl_plugin_demo:broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.warns(UserWarning, match="'broken'.*failed to register: plugin bug"):
            status = k3rl.envs.load_entry_points()
        assert status["demo"] == "ok" and status["broken"].startswith("RuntimeError")
        assert "plugin/Echo-v0" in tool_env_ids()
        env = gym.make("plugin/Echo-v0").unwrapped
        assert env.num_keys == 2
    finally:
        gym.registry.pop("plugin/Echo-v0", None)
        sys.modules.pop("k3rl_plugin_demo", None)
        from k3rl.envs import registration

        registration._loaded.pop("demo", None)
        registration._loaded.pop("broken", None)
