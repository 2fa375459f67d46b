"""The built-in environments, registered under the Gymnasium namespace `k3rl`.

`register_all()` is idempotent; it is also the `builtin` entry point of the group `k3rl.envs`.
"""

from __future__ import annotations

import gymnasium as gym

BUILTIN_ENVS: dict[str, str] = {
    "k3rl/KeyLookup-v0": "k3rl.envs.key_lookup:KeyLookupEnv",
    "k3rl/PythonTool-v0": "k3rl.envs.python_tool:PythonToolEnv",
    "k3rl/CodeFix-v0": "k3rl.envs.code_fix:CodeFixEnv",
    "k3rl/ChartMatch-v0": "k3rl.envs.chart_match:ChartMatchEnv",
    "k3rl/LongHorizon-v0": "k3rl.envs.long_horizon:LongHorizonEnv",
    "k3rl/McpFiles-v0": "k3rl.envs.mcp_files:McpFilesEnv",
    "k3rl/ScreenRead-v0": "k3rl.envs.screen_read:ScreenReadEnv",
    "k3rl/Agent-v0": "k3rl.envs.agent:AgentEnv",
}

DESCRIPTIONS: dict[str, str] = {
    "k3rl/KeyLookup-v0": "look a key up with a tool, answer its value (tiny, CPU-learnable, no sandbox)",
    "k3rl/PythonTool-v0": "arithmetic and word problems with a sandboxed Python interpreter",
    "k3rl/CodeFix-v0": "fix a bug in a small repository until the hidden tests pass (sandbox)",
    "k3rl/ChartMatch-v0": "reproduce a target chart image with matplotlib/SVG; vision in the loop (sandbox)",
    "k3rl/LongHorizon-v0": "follow a trail of 24 files through a directory tree and add it up; needs context "
                           "compaction (sandbox)",
    "k3rl/McpFiles-v0": "answer from the sandbox's files, read through an MCP server running in the sandbox",
    "k3rl/ScreenRead-v0": "open a panel of an app, read its number off the screenshot; vision in the loop (tiny, "
                          "CPU-learnable, no sandbox)",
    "k3rl/Agent-v0": "your own agent harness (kwargs agent: module:solve, tasks: module:TASKS) against an "
                     "OpenAI-compatible endpoint; trained on the tokens it sampled",
}


def register_all() -> list[str]:
    """Register every built-in environment that is not registered yet; returns the ids."""
    for env_id, entry_point in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, nondeterministic=False)
    return list(BUILTIN_ENVS)
