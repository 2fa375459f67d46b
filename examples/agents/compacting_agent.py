"""A harness that manages its own context: after each tool result it replaces its history with a short note of
what it learned, as agents that summarise or drop old tool output do. Every call after the first therefore
rewrites the history, and k3rl trains the episode as segments, one per context the model actually saw.

    envs:
      train: [{id: k3rl/Agent-v0, kwargs: {agent: "k3rl.examples.agents.compacting_agent:solve",
                                           tasks: "k3rl.examples.agents.openai_loop:task"}}]
"""

from __future__ import annotations

import json


def solve(base_url: str, model: str, task: dict, max_turns: int = 4) -> float:
    # the agent's own dependency, imported where it runs (a rollout worker): k3rl itself needs no openai
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="k3rl")
    ask = f"keys {' '.join(task['table'])}; lookup {task['key']}"
    messages = [{"role": "user", "content": ask}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=128).choices[0].message
        if not reply.tool_calls:
            return float((reply.content or "").strip() == task["table"][task["key"]])
        notes = []
        for call in reply.tool_calls:
            key = json.loads(call.function.arguments or "{}").get("key", "")
            notes.append(f"{key} = {task['table'].get(key, 'no such key')}")
        # the compaction: the history is gone, a note of what the tools said takes its place
        messages = [{"role": "user", "content": f"{ask}\nnotes: {'; '.join(notes)}"}]
    return 0.0
