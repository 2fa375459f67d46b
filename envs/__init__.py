"""Gymnasium tool environments: `ToolEnv`, tool declarations, built-in environments.

    import gymnasium as gym
    import k3rl.envs  # registers k3rl/* and the entry points of the group `k3rl.envs`

    env = gym.make("k3rl/KeyLookup-v0")
    obs, info = env.reset(seed=0)
    action = env.unwrapped.oracle()           # scripted policy -> assistant message text
    obs, reward, terminated, truncated, info = env.step(action)
"""

from k3rl.envs.actions import action_to_ids, assistant_text, encode_with_specials, parse_action
from k3rl.envs.base import EpisodeNotActiveError, NoOracleError, ToolEnv
from k3rl.envs.builtin import BUILTIN_ENVS, register_all
from k3rl.envs.registration import (
    ENTRY_POINT_GROUP,
    check_env_ids,
    import_env_modules,
    load_entry_points,
    unknown_env_message,
)
from k3rl.envs.spaces import AssistantAction, ChatMessages, message_dict
from k3rl.envs.timings import Timings
from k3rl.envs.tools import Tool, ToolArgumentError, ToolError, ToolResult, tool

register_all()
load_entry_points()

__all__ = [
    "BUILTIN_ENVS", "ENTRY_POINT_GROUP", "AssistantAction", "ChatMessages", "EpisodeNotActiveError",
    "NoOracleError", "Timings", "Tool", "ToolArgumentError", "ToolEnv", "ToolError", "ToolResult", "action_to_ids",
    "assistant_text", "check_env_ids", "encode_with_specials", "import_env_modules", "load_entry_points",
    "message_dict", "parse_action", "register_all", "tool", "unknown_env_message",
]
