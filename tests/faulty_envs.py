"""A user's environment module outside the package, for the fault-injection job tests: importing it
registers `faulty/FlakyLookup-v0`, a KeyLookup whose infrastructure fails at random.

* `reset` raises for a share `reset_fails` of the seeds (whole prompt groups fail: their episodes
  share the seed); seed 0, which the start-of-job check uses, never does; `reset_hangs_s` makes every
  reset wait that long first;
* the `lookup` tool dies with a SandboxError (an infrastructure failure: the episode fails, the
  model is not told) with probability `tool_failure` per call.
"""

from __future__ import annotations

import random
import time

import gymnasium

from k3rl.envs.key_lookup import KeyLookupEnv
from k3rl.envs.tools import ToolError, tool
from k3rl.sandboxes import SandboxError


class FlakyLookupEnv(KeyLookupEnv):
    def __init__(self, tool_failure: float = 0.3, reset_fails: float = 0.25, reset_hangs_s: float = 0.0, **kwargs):
        self.tool_failure, self.reset_fails, self.reset_hangs_s = tool_failure, reset_fails, reset_hangs_s
        super().__init__(**kwargs)

    def reset(self, *, seed=None, options=None):
        time.sleep(self.reset_hangs_s)  # a service that does not answer
        if seed and (seed % 1000) < 1000 * self.reset_fails:
            raise RuntimeError(f"injected: reset failed for seed {seed}")
        return super().reset(seed=seed, options=options)

    @tool
    def lookup(self, key: str) -> str:
        """Value of a key."""
        if random.random() < self.tool_failure:
            raise SandboxError("injected: the tool's backend died")
        return KeyLookupEnv.lookup.fn(self, key)


if "faulty/FlakyLookup-v0" not in gymnasium.registry:
    gymnasium.register("faulty/FlakyLookup-v0", entry_point=FlakyLookupEnv)


class SandboxedLookupEnv(KeyLookupEnv):
    """KeyLookup whose table lives in the episode's sandbox: reset writes one file per key into it
    and `lookup` reads the file there (so every episode holds a real container or bwrap sandbox)."""

    uses_sandbox = True

    def opening_messages(self, task):
        for key, value in zip(task.keys, task.values, strict=True):
            self.sandbox.write_file(f"keys/{key}", value)
        return super().opening_messages(task)

    @tool
    def lookup(self, key: str) -> str:
        """Value of a key."""
        self._looked_up.append(key)
        if key not in self.task.keys:
            raise ToolError(f"no key {key!r}; keys: {' '.join(self.task.keys)}")
        return self.sandbox.exec(["cat", f"keys/{key}"], timeout=10).stdout.strip()


if "faulty/SandboxedLookup-v0" not in gymnasium.registry:
    gymnasium.register("faulty/SandboxedLookup-v0", entry_point=SandboxedLookupEnv)
