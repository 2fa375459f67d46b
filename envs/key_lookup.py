"""`k3rl/KeyLookup-v0`: the smallest multi-turn tool task — look a key up, then say its value.

    user:      keys a7 b2 q9; lookup b2
    assistant: (call) lookup(key="b2")
    tool:      417
    assistant: 417                       -> reward 1 (exact value), episode ends

Built so a few-million-parameter model with the byte tokenizer learns it on a CPU in
minutes: every string is short, the first turn is a copy of the requested key from the
prompt (learnable from the prompt alone), the second a copy of the tool's answer. Difficulty
is the number of keys (`num_keys`: distractors the model must not copy). Pure Python, no
sandbox.

Token budget with the byte tokenizer and the K3 template (measured in
tests/envs/test_key_lookup.py): an oracle episode is ~320 tokens without the tool
declaration, and the declaration alone adds ~300. So by default the tool is *not* declared
(`declare_tools=False`): the prompt names it ("lookup b2") and the SFT warm start teaches the
call format. `declare_tools=True` puts the usual JSON declaration in the prompt.
"""

from __future__ import annotations

import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.tools import ToolError, tool


@dataclass(frozen=True)
class KeyLookupTask:
    keys: tuple[str, ...]
    values: tuple[str, ...]
    key: str

    @property
    def id(self) -> str:
        return f"{' '.join(self.keys)}|{self.key}"

    @property
    def value(self) -> str:
        return self.values[self.keys.index(self.key)]


class KeyLookupEnv(ToolEnv):
    """Find the value of a key with the `lookup` tool and answer with it. Reward 1 for the exact value."""

    default_max_turns = 4
    declare_tools_by_default = False

    def __init__(self, num_keys: int = 3, value_digits: int = 3,
                 partial_credit: bool = False, turn_rewards: bool = False, key_letters: str = string.ascii_lowercase, key_digit: bool = True,
                 step_delay_s: float = 0.0, step_delay_sigma: float = 0.0, oracle_wrong_key: float = 0.0,
                 **kwargs: Any) -> None:
        if len(set(key_letters)) != len(key_letters) or not key_letters.isalpha():
            raise ValueError(f"key_letters must be distinct letters, got {key_letters!r}")
        if not 1 <= num_keys <= len(key_letters):
            raise ValueError(f"num_keys must be in 1..{len(key_letters)} (one letter each), got {num_keys}")
        if not 1 <= value_digits <= 9:
            raise ValueError(f"value_digits must be in 1..9, got {value_digits}")
        self.num_keys = num_keys
        self.value_digits = value_digits
        self.partial_credit = partial_credit
        if turn_rewards and not partial_credit:
            raise ValueError("turn_rewards splits the partial credit over the turns; set partial_credit=True too")
        self.turn_rewards = turn_rewards
        self.key_letters = key_letters
        self.key_digit = key_digit
        if step_delay_s < 0 or step_delay_sigma < 0:
            raise ValueError("step_delay_s and step_delay_sigma must be >= 0")
        self.step_delay_s = step_delay_s
        self.step_delay_sigma = step_delay_sigma
        if not 0.0 <= oracle_wrong_key <= 1.0:
            raise ValueError(f"oracle_wrong_key is a probability in [0, 1], got {oracle_wrong_key}")
        if oracle_wrong_key > 0 and num_keys < 2:
            raise ValueError("oracle_wrong_key needs num_keys >= 2 (another key to look up)")
        self.oracle_wrong_key = oracle_wrong_key
        self._oracle_key: str | None = None
        self._looked_up: list[str] = []
        super().__init__(**kwargs)

    def generate_task(self, rng, options: dict[str, Any]) -> KeyLookupTask:
        letters = rng.choice(list(self.key_letters), size=self.num_keys, replace=False)
        keys = tuple(f"{c}{int(rng.integers(10))}" if self.key_digit else str(c) for c in letters)
        lo = 10 ** (self.value_digits - 1) if self.value_digits > 1 else 0
        values = tuple(str(int(rng.integers(lo, 10 ** self.value_digits))) for _ in keys)
        return KeyLookupTask(keys, values, keys[int(rng.integers(len(keys)))])

    def opening_messages(self, task: KeyLookupTask) -> list[Message]:
        return [Message(role="user", content=f"keys {' '.join(task.keys)}; lookup {task.key}")]

    @tool
    def lookup(self, key: str) -> str:
        """Value of a key."""
        self._looked_up.append(key)
        if key not in self.task.keys:
            raise ToolError(f"no key {key!r}; keys: {' '.join(self.task.keys)}")
        return self.task.values[self.task.keys.index(key)]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._looked_up = []
        self._oracle_key = None  # the key this episode's oracle looks up (drawn at its first call)
        self._key_credit = {"valid_key": 0.0, "requested_key": 0.0}  # what the lookup turns earned (turn_rewards)
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        """With `step_delay_s`, every step first waits step_delay_s * lognormal(0, sigma) seconds:
        a simulated long-tailed environment latency (sandbox start, slow tools) for pipeline
        benchmarks. The draw comes from the episode's seeded RNG, so it is reproducible."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s * float(self.np_random.lognormal(0.0, self.step_delay_sigma)))
        looked_up = len(self._looked_up)
        obs, reward, terminated, truncated, info = super().step(action)
        if self.turn_rewards:  # the key credit is paid in the turn that earned it, once
            parts = {k: v - self._key_credit[k] for k, v in self._key_parts().items()}
            self._key_credit = self._key_parts()
            reward += sum(parts.values())
            if len(self._looked_up) > looked_up:  # a lookup turn says what it earned (0 too)
                info["reward_parts"] = {**parts, **info.get("reward_parts", {})}
        return obs, reward, terminated, truncated, info

    def _key_parts(self) -> dict[str, float]:
        return {"valid_key": 0.25 if any(k in self.task.keys for k in self._looked_up) else 0.0,
                "requested_key": 0.25 if self.task.key in self._looked_up else 0.0}

    def score(self, final_text: str) -> dict[str, float]:
        """1 for the exact value. With `partial_credit` (a shaped reward for tiny models):
        0.25 for having looked up a key that exists + 0.25 for the requested key + 0.5 for
        the exact value, so the reward also rises while copying is still being learned. With
        `turn_rewards` the same credit is paid per turn: the key's 0.5 in the turn that looked it up,
        the value's 0.5 in the answer's turn (the episode's total is unchanged), so per-turn
        advantages (learner.advantage: turn_grpo) credit each turn with what it earned: a right
        key followed by a wrong value no longer reinforces the wrong value. Returned as its parts
        (valid_key, requested_key, exact_value), which the reward sums."""
        correct = 1.0 if final_text.strip() == self.task.value else 0.0
        if not self.partial_credit:
            return {"exact_value": correct}
        if self.turn_rewards:  # the key credit was paid in the lookup turns (step)
            return {"exact_value": 0.5 * correct}
        return {**self._key_parts(), "exact_value": 0.5 * correct}

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Call lookup on the requested key; once the value came back, answer with it.

        With `oracle_wrong_key` = q, a careless demonstrator: with probability q (drawn once per
        episode from its seeded RNG) it looks up another of the task's keys instead, then answers
        with the value that came back, consistently. A policy imitating it succeeds on about 1 - q
        of the tasks while it has every skill the task needs (calling the tool, copying a key,
        copying the answer): what RL can improve on its warm start is the choice of key."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        if last is not None and last.role == "tool" and last.tool_name == "lookup" and not last.content.startswith("Error"):
            return self.say(last.content)
        if self._oracle_key is None:
            self._oracle_key = self.task.key
            if self.oracle_wrong_key > 0 and self.np_random.random() < self.oracle_wrong_key:
                others = [k for k in self.task.keys if k != self.task.key]
                self._oracle_key = others[int(self.np_random.integers(len(others)))]
        return self.say(tool_calls=[{"name": "lookup", "arguments": {"key": self._oracle_key}}])
