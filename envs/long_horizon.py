"""`k3rl/LongHorizon-v0`: follow a trail of files through a generated directory tree and add up
what it holds — more turns and tokens than one context holds.

A sandbox holds a directory tree `ledger/` of log files. The trail starts at
`ledger/start.log`; every file on it is a few lines of log noise with one `amount: N` line and
one `next: PATH` line (the last says `next: none`). Other files of the tree (decoys) look the
same but are not on the trail, so listing and summing the tree gives the wrong answer. The
agent reads the files one by one with `read_file` (one tool call per file: `hops` of them, 24
by default) and answers with the sum of the trail's amounts. Reward 1 when the answer's last
number is that sum, else 0; with `progress_reward`, each step that first reads a file of the
trail also earns that much (a per-step reward, for `learner.advantage: turn_grpo`).

With the byte tokenizer every file costs about 200 tokens, so the whole trail is several times
`rollout.max_context_tokens` (2048 by default): the episode only finishes with context
compaction (`rollout.context.strategy: summarize`, or `drop_tool_outputs` for shorter trails),
which is what the env is for. Set `envs.max_turns` to at least hops + 1.

The oracle reads the trail in order and keeps the running total in its messages; asked for a
summary (`oracle_summary`), it states the total so far and the next file.

`goal="codes"` is the memory variant for small policies (examples/agent.yaml): short file names
(`kamiro.txt`), no log noise, the start file holds `code: D1` and the last file `code: D2`, and the
answer is both digits, `D1D2`. The trail overflows the context, and the start file's code is needed
at the very end, so the policy must carry it through its own summaries (`rollout.context.strategy:
summarize`): a summary that drops it loses the episode. The oracle notes `code D1` beside each call
after the start file's and summarises `code D1`. `short_names=True` names the files with one letter
(`q.txt`): the name a small policy must copy from one file into its next call is one character, not six. `oracle_mistakes=q` makes it careless (with
probability q, once per episode, it keeps no notes, its summaries keep only the progress, and its final
answer has "?" for the first code, which earns nothing). Partial credit: 0.5 per code in its place when the
answer is two characters (digits, or "?" for a code it does not know): "?4" earns the last code's 0.5.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.sandboxed import read_text
from k3rl.envs.tools import tool

LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYLLABLES = ("ka", "ro", "mi", "tu", "sel", "van", "dor", "pe", "lix", "quo", "ba", "ne")
START = "ledger/start.log"
SETUP_SCRIPT = ".k3rl-ledger-setup.py"


@dataclass(frozen=True)
class Trail:
    files: dict[str, str]  # path -> content, trail and decoys
    path: tuple[str, ...]  # the trail's files, in order
    amounts: tuple[int, ...]
    seed_name: str

    @property
    def id(self) -> str:
        return f"trail-{self.seed_name}-{len(self.path)}"

    @property
    def total(self) -> int:
        return sum(self.amounts)


def _name(rng, parts: int) -> str:
    return "".join(SYLLABLES[int(rng.integers(len(SYLLABLES)))] for _ in range(parts))


def _log(rng, amount: int, nxt: str, noise_lines: int) -> str:
    lines = [f"op={_name(rng, 2)} id={int(rng.integers(16 ** 6)):06x} ok" for _ in range(noise_lines)]
    lines.insert(int(rng.integers(len(lines) + 1)), f"amount: {amount}")
    return "\n".join(lines + [f"next: {nxt}"]) + "\n"


def make_code_trail(rng, hops: int, decoys: int, short_names: bool = False) -> Trail:
    """The `codes` variant: `hops` files from START.txt, each naming the next; the first and the last
    also hold a one-digit code (their `amounts`); `decoys` files off the trail. `short_names`: one
    letter a file (`q.txt`) instead of two syllables (`kamiro.txt`)."""
    names: list[str] = ["start.txt"]
    if short_names and hops + decoys > 27:
        raise ValueError(f"short_names has 26 one-letter names, too few for hops + decoys = {hops + decoys}")
    while len(names) < hops + decoys:
        n = f"{LETTERS[int(rng.integers(26))]}.txt" if short_names else f"{_name(rng, 2)}.txt"
        if n not in names:
            names.append(n)
    trail, others = names[:hops], names[hops:]
    codes = (int(rng.integers(10)), int(rng.integers(10)))
    files = {}
    for i, p in enumerate(trail):
        lines = [f"next: {trail[i + 1] if i + 1 < hops else 'none'}"]
        if i == 0:
            lines.insert(0, f"code: {codes[0]}")
        if i == hops - 1:
            lines.insert(0, f"code: {codes[1]}")
        files[p] = "\n".join(lines) + "\n"
    for p in others:
        files[p] = f"next: {others[int(rng.integers(len(others)))]}\n"
    return Trail(files, tuple(trail), codes, f"{int(rng.integers(16 ** 4)):04x}")


def make_trail(rng, hops: int, decoys: int, noise_lines: int) -> Trail:
    """A tree of `hops` trail files (the first is START) and `decoys` others, drawn from `rng`."""
    dirs = [f"ledger/{_name(rng, 1)}{i}" for i in range(max(2, hops // 4))]
    paths: list[str] = [START]
    while len(paths) < hops + decoys:
        p = f"{dirs[int(rng.integers(len(dirs)))]}/{_name(rng, 2)}.log"
        if p not in paths:
            paths.append(p)
    trail, others = paths[:hops], paths[hops:]
    amounts = tuple(int(rng.integers(1, 100)) for _ in trail)
    files = {p: _log(rng, a, trail[i + 1] if i + 1 < hops else "none", noise_lines)
             for i, (p, a) in enumerate(zip(trail, amounts, strict=True))}
    for p in others:  # decoys point at each other, never into the trail
        files[p] = _log(rng, int(rng.integers(1, 100)), others[int(rng.integers(len(others)))], noise_lines)
    return Trail(files, tuple(trail), amounts, f"{int(rng.integers(16 ** 4)):04x}")


class LongHorizonEnv(ToolEnv):
    """Follow the trail of files from ledger/start.log; answer the sum of its amounts. Reward 1 for the exact sum."""

    default_max_turns = 40
    uses_sandbox = True

    def __init__(self, hops: int = 24, decoys: int = 12, noise_lines: int = 3, progress_reward: float = 0.0,
                 goal: str = "sum", partial_credit: bool = False, oracle_mistakes: float = 0.0,
                 short_names: bool = False, **kwargs: Any) -> None:
        if hops < 1 or decoys < 1 or noise_lines < 0:
            raise ValueError(f"need hops >= 1, decoys >= 1 and noise_lines >= 0; got hops={hops}, decoys={decoys}, "
                             f"noise_lines={noise_lines}")
        if progress_reward < 0:
            raise ValueError(f"progress_reward must be >= 0, got {progress_reward}")
        if goal not in ("sum", "codes"):
            raise ValueError(f"goal must be 'sum' (add the trail's amounts) or 'codes' (the first and last codes), "
                             f"got {goal!r}")
        if goal == "codes" and hops < 2:
            raise ValueError("goal 'codes' needs hops >= 2 (the codes are in the first and the last file)")
        if (partial_credit or oracle_mistakes or short_names) and goal != "codes":
            raise ValueError("partial_credit, oracle_mistakes and short_names belong to goal 'codes'")
        if not 0.0 <= oracle_mistakes <= 1.0:
            raise ValueError(f"oracle_mistakes is a probability in [0, 1], got {oracle_mistakes}")
        self.hops, self.decoys, self.noise_lines = hops, decoys, noise_lines
        self.progress_reward, self.goal = progress_reward, goal
        self.partial_credit, self.oracle_mistakes, self.short_names = partial_credit, oracle_mistakes, short_names
        self._found: set[str] = set()
        self._new_finds = 0
        self._careless: bool | None = None
        super().__init__(**kwargs)

    @property
    def start(self) -> str:
        return "start.txt" if self.goal == "codes" else START

    def generate_task(self, rng, options: dict[str, Any]) -> Trail:
        self._found, self._new_finds, self._careless = set(), 0, None
        if self.goal == "codes":
            return make_code_trail(rng, self.hops, self.decoys, self.short_names)
        return make_trail(rng, self.hops, self.decoys, self.noise_lines)

    def opening_messages(self, task: Trail) -> list[Message]:
        if self.goal == "codes":
            return [Message(role="user", content="trail from start.txt; answer its first and last code")]
        return [Message(role="user", content=(
            f"Follow the trail of files from {START} (each names an amount and the next file; next: none ends it). "
            "Reply with the sum of the trail's amounts, the number only."))]

    def setup_sandbox(self, sandbox: Any) -> None:
        # one write and one command, however many files the tree has
        sandbox.write_file(SETUP_SCRIPT, (
            "import json, os, sys\n"
            f"files = json.loads({json.dumps(json.dumps(self.task.files))})\n"
            "for path, text in files.items():\n"
            "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n"
            "    open(path, 'w').write(text)\n"
            "os.remove(sys.argv[0])\n"))
        result = sandbox.exec(f"python3 {SETUP_SCRIPT}", timeout=60)
        if not result.ok:
            raise RuntimeError(f"writing the ledger tree failed: {result.stderr[-500:]}")

    @tool
    def read_file(self, path: str) -> str:
        """Read a file.

        Args:
            path: the file's path.
        """
        text = read_text(self.sandbox, path)
        if path in self.task.path and path not in self._found:
            self._found.add(path)
            self._new_finds += 1
        return text

    def step(self, action: Any):
        """The base step, plus `progress_reward` for each trail file read for the first time."""
        self._new_finds = 0
        obs, reward, terminated, truncated, info = super().step(action)
        if self._new_finds and self.progress_reward:
            info["reward_parts"] = {**info.get("reward_parts", {}), "progress": self.progress_reward * self._new_finds}
        return obs, reward + self.progress_reward * self._new_finds, terminated, truncated, info

    def reward_parts(self, final_text: str) -> dict[str, float]:
        """goal 'codes': 0.5 for each code in its place of the answer (two characters: digits, or "?")."""
        said = re.sub(r"[^\d?]", "", final_text)  # "?4": the first code forgotten, said so; the last one right
        first, last = (str(a) for a in self.task.amounts)
        return {"first_code": 0.5 if len(said) == 2 and said[0] == first else 0.0,
                "last_code": 0.5 if len(said) == 2 and said[1] == last else 0.0}

    def score(self, final_text: str) -> float:
        if self.goal == "codes":
            parts = self.reward_parts(final_text)
            return sum(parts.values()) if self.partial_credit else float(all(parts.values()))
        numbers = re.findall(r"-?\d+", final_text)
        return 1.0 if numbers and int(numbers[-1]) == self.task.total else 0.0

    # -- the oracle --------------------------------------------------------------------------
    def _progress(self, history: Sequence[Message | dict] | None) -> tuple[int, int, str | None]:
        """(files of the trail read, their total, the next file; None at the end) from the conversation."""
        read, total, nxt = 0, 0, self.start
        for m in self._messages(history):
            if m.role != "tool" or m.tool_name != "read_file" or m.content.startswith("Error"):
                continue
            amount = re.search(r"^amount: (\d+)$", m.content, re.M)
            step = re.search(r"^next: (\S+)$", m.content, re.M)
            if amount and step:
                read, total = read + 1, total + int(amount.group(1))
                nxt = None if step.group(1) == "none" else step.group(1)
        return read, total, nxt

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Read the next file of the trail (saying the running total); at its end, answer the total.
        goal 'codes': read the next file (saying nothing); at the end answer the two codes, the first
        from memory: the start file's output if still in context, else the summary's."""
        if self.goal == "codes":
            return self._code_oracle(history)
        read, total, nxt = self._progress(history)
        if nxt is None:
            return self.say(str(total))
        return self.say(f"total {total}", [{"name": "read_file", "arguments": {"path": nxt}}])

    def oracle_summary(self, history: Sequence[Message | dict] | None = None) -> str:
        """The oracle's answer to the loop's summary request."""
        if self.goal == "codes":
            first = self._remembered_code(history)
            return self.say(f"code {first}" if first is not None and not self._is_careless() else "reading")
        read, total, nxt = self._progress(history)
        return self.say(f"{read} files read, total {total}, next {nxt or 'none'}")

    # -- goal 'codes' ---------------------------------------------------------------------------
    def _is_careless(self) -> bool:
        if self._careless is None:
            self._careless = bool(self.oracle_mistakes > 0 and self.np_random.random() < self.oracle_mistakes)
        return self._careless

    def _remembered_code(self, history: Sequence[Message | dict] | None) -> str | None:
        """The start file's code as the conversation (what is still in context) holds it."""
        code = None
        for m in self._messages(history):
            if m.role == "tool" and m.tool_name == "read_file" and "next:" in m.content:
                found = re.search(r"^code: (\d)$", m.content, re.M)
                if found and code is None:
                    code = found.group(1)
            elif m.role in ("user", "assistant") and (said := re.search(r"\bcode (\d)\b", m.content)):
                code = said.group(1)  # a note or a summary of this episode (context compaction)
        return code

    def _code_oracle(self, history: Sequence[Message | dict] | None) -> str:
        messages = self._messages(history)
        last = next((m for m in reversed(messages) if m.role == "tool" and m.tool_name == "read_file"), None)
        if last is None:
            return self.say(tool_calls=[{"name": "read_file", "arguments": {"path": self.start}}])
        step = re.search(r"^next: (\S+)$", last.content, re.M)
        if step and step.group(1) != "none":
            # a note of the first code beside each call: the policy copies it from its own last message,
            # a hundred tokens back, not from the start file, hundreds back (k3-tiny copied that at chance)
            first = None if self._is_careless() else self._remembered_code(messages)
            return self.say(f"code {first}" if first is not None else "",
                            [{"name": "read_file", "arguments": {"path": step.group(1)}}])
        final = re.search(r"^code: (\d)$", last.content, re.M)
        first = self._remembered_code(messages)
        if first is None or (self._is_careless() and self.hops > 1):
            first = "?"  # forgotten: said so (a made-up digit would teach the policy to write random digits)
        return self.say(f"{first}{final.group(1) if final else '0'}")
