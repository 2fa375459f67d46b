"""An agent that runs inside the episode's sandbox (`sandboxed: true`) and acts there: its lookup tool is a shell
command over a file in the sandbox's /work. Standard library only (the sandbox image has no `openai`): the
chat calls are plain HTTP to `base_url`, a port on the sandbox's own loopback that k3rl relays to the
endpoint; the sandbox itself has no network.

    envs:
      train: [{id: k3rl/Agent-v0, kwargs: {agent: "k3rl.examples.agents.sandboxed_agent:solve",
                                           tasks: "k3rl.examples.agents.openai_loop:task", sandboxed: true}}]
"""

import json
import subprocess
import urllib.request


def chat(base_url: str, model: str, messages: list) -> dict:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 128}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer k3rl"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]


def solve(base_url: str, model: str, task: dict, max_turns: int = 4) -> float:
    with open("/work/table.json", "w") as f:  # the task's data lives in the sandbox, where the tool reads it
        json.dump(task["table"], f)
    messages = [{"role": "user", "content": f"keys {' '.join(task['table'])}; lookup {task['key']}"}]
    for _ in range(max_turns):
        reply = chat(base_url, model, messages)
        messages.append({k: v for k, v in reply.items() if v is not None})
        if not reply.get("tool_calls"):  # the answer
            return float((reply.get("content") or "").strip() == task["table"][task["key"]])
        for call in reply["tool_calls"]:  # the tool runs as a process in the sandbox
            key = json.loads(call["function"]["arguments"] or "{}").get("key", "")
            script = "import json, sys; t = json.load(open('/work/table.json')); print(t.get(sys.argv[1], "
            result = subprocess.run(["python3", "-c", script + "'no key %r' % sys.argv[1]))", str(key)],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 0.0
