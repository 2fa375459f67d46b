"""A tool-calling agent as users write one: the `openai` client in a loop, tools run by the agent itself.

    envs:
      train: [{id: k3rl/Agent-v0, kwargs: {agent: "k3rl.examples.agents.openai_loop:solve",
                                           tasks: "k3rl.examples.agents.openai_loop:task"}}]

The task is KeyLookup's (look a key up, answer its value), so the demo's warm start can play it.
"""

from __future__ import annotations

import json
import random


def task(seed: int, num_keys: int = 2, letters: str = "abcd") -> dict:
    """A key table and the key to look up, drawn from `seed` (the demo's KeyLookup: letter keys, digit values)."""
    rng = random.Random(seed)
    keys = rng.sample(letters, num_keys)
    return {"id": f"lookup-{seed}", "table": {k: str(rng.randrange(10)) for k in keys}, "key": rng.choice(keys)}


def solve(base_url: str, model: str, task: dict, max_turns: int = 4) -> float:
    # the agent's own dependency, imported where it runs (a rollout worker): k3rl itself needs no openai
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="k3rl")
    messages = [{"role": "user", "content": f"keys {' '.join(task['table'])}; lookup {task['key']}"}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=128).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:  # the answer
            return float((reply.content or "").strip() == task["table"][task["key"]])
        for call in reply.tool_calls:  # the agent runs its tools itself
            key = json.loads(call.function.arguments or "{}").get("key", "")
            result = task["table"].get(key, f"no key {key!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
