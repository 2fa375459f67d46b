"""Agents the sandboxed `k3rl/Agent-v0` tests copy into a sandbox: standard library only, as they run there."""

import json
import os
import urllib.request


def lo_only_agent(base_url, model, task):
    """One chat call over the relay, then the reward 1 only if the sandbox has no network interface but `lo`."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["object"] == "chat.completion"
    interfaces = sorted(os.listdir("/sys/class/net"))
    if interfaces != ["lo"]:
        raise RuntimeError(f"the sandbox has network interfaces {interfaces}")
    print("this print goes to stderr, not into the relay")
    return 1.0 if os.getcwd() == "/work" else 0.5


def raising_agent(base_url, model, task):
    raise ValueError(f"broke inside the sandbox on {task['id']}")
