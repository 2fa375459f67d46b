"""`k3rl/PythonTool-v0`: arithmetic and word problems, solved with a Python interpreter in a sandbox.

The numbers are large enough that computing in the head is unreliable, so the useful policy
is: write a short program, call `python(code=...)`, read the printed result, answer.
Reward 1 when the final answer's last integer equals the exact answer (commas and
underscores inside numbers are ignored), else 0.

Task families (generated from the seed): products and sums of big numbers, modular
powers, sums of ranges, digit sums of powers, counting multiples, and a few word problems.
Each task carries the program the oracle sends to the interpreter.
`reset(options={"family": "modpow"})` picks a family; `families=[...]` restricts the set.

For small policies (the agentic mixture of examples/agent.yaml): the family `mul` ("37*58": two
2-digit numbers, the program `print(37*58)`), `system_prompt=None` and `declare_tools=False` (the
prompt alone says what to do: ~20 tokens instead of ~400), `partial_credit` with `turn_rewards`
(0.5 in the turn whose program printed the answer, 0.5 for the exact final answer), and
`oracle_mistakes=q`: a careless demonstrator that, with probability q (once per episode), answers
at once "?" instead of running the program (no made-up number: demonstrations of random digits taught
a warm start to miscopy the task's numbers); in the family `mul` it runs the sum instead of the
product (`print(37+58)`), a wrong choice of one token that copies the task's numbers right.
`tool_available=False` is the ablation: the `python` tool answers that it is unavailable, so a policy
must compute in its head (success drops to chance: a guess of a 3-4 digit product).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.sandboxed import format_exec
from k3rl.envs.tools import ToolError, tool


@dataclass(frozen=True)
class PythonTask:
    family: str
    question: str
    code: str  # the oracle's program; it prints the answer
    answer: int

    @property
    def id(self) -> str:
        return f"{self.family}:{self.question}"


def _product(r) -> PythonTask:
    a, b, c = (int(r.integers(1000, 99999)) for _ in range(3))
    return PythonTask("product", f"Compute {a} * {b} - {c}.", f"print({a} * {b} - {c})", a * b - c)


def _modpow(r) -> PythonTask:
    base, exp, mod = int(r.integers(2, 50)), int(r.integers(20, 200)), int(r.integers(1000, 100000))
    return PythonTask("modpow", f"What is {base}^{exp} mod {mod}?", f"print(pow({base}, {exp}, {mod}))",
                      pow(base, exp, mod))


def _range_sum(r) -> PythonTask:
    lo, hi = int(r.integers(1, 500)), int(r.integers(1000, 100000))
    return PythonTask("range_sum", f"What is the sum of all integers from {lo} to {hi} inclusive?",
                      f"print(sum(range({lo}, {hi} + 1)))", sum(range(lo, hi + 1)))


def _digit_sum(r) -> PythonTask:
    base, exp = int(r.integers(2, 10)), int(r.integers(30, 300))
    return PythonTask("digit_sum", f"What is the sum of the decimal digits of {base}^{exp}?",
                      f"print(sum(int(d) for d in str({base} ** {exp})))", sum(int(d) for d in str(base ** exp)))


def _multiples(r) -> PythonTask:
    n, a, b = int(r.integers(1000, 100000)), int(r.integers(3, 20)), int(r.integers(3, 20))
    count = sum(1 for i in range(1, n + 1) if i % a == 0 or i % b == 0)
    return PythonTask("multiples", f"How many integers from 1 to {n} are divisible by {a} or by {b}?",
                      f"print(sum(1 for i in range(1, {n} + 1) if i % {a} == 0 or i % {b} == 0))", count)


def _apples(r) -> PythonTask:
    crates, per, sold = int(r.integers(12, 90)), int(r.integers(24, 150)), int(r.integers(50, 400))
    kept = crates * per - sold
    kept -= kept // 3
    q = (f"A farmer has {crates} crates of {per} apples each. He sells {sold} apples, then gives away "
         "a third of the rest (rounded down). How many apples does he keep?")
    code = f"rest = {crates} * {per} - {sold}\nrest -= rest // 3\nprint(rest)"
    return PythonTask("apples", q, code, kept)


def _savings(r) -> PythonTask:
    start, rate, years = int(r.integers(1000, 20000)), int(r.integers(2, 9)), int(r.integers(5, 30))
    money = start
    for _ in range(years):
        money = money * (100 + rate) // 100
    q = (f"A savings account starts with {start} coins and earns {rate}% interest per year; each year the "
         f"balance is rounded down to whole coins. How many coins are in it after {years} years?")
    code = f"m = {start}\nfor _ in range({years}):\n    m = m * (100 + {rate}) // 100\nprint(m)"
    return PythonTask("savings", q, code, money)


def _trains(r) -> PythonTask:
    a, b, gap = int(r.integers(40, 130)), int(r.integers(40, 130)), int(r.integers(100, 2000))
    minutes = -(-gap * 60 // (a + b))  # ceil(gap / (a + b) hours) in minutes
    q = (f"Two trains start {gap} km apart and drive towards each other at {a} km/h and {b} km/h. "
         "After how many whole minutes (rounded up) do they meet?")
    code = f"print(-(-{gap} * 60 // ({a} + {b})))"
    return PythonTask("trains", q, code, minutes)


def _mul(r) -> PythonTask:
    a, b = int(r.integers(11, 100)), int(r.integers(11, 100))
    return PythonTask("mul", f"{a}*{b}", f"print({a}*{b})", a * b)


FAMILIES: dict[str, Callable[[Any], PythonTask]] = {
    "product": _product, "modpow": _modpow, "range_sum": _range_sum, "digit_sum": _digit_sum,
    "multiples": _multiples, "apples": _apples, "savings": _savings, "trains": _trains, "mul": _mul,
}
DEFAULT_FAMILIES = [f for f in FAMILIES if f != "mul"]
SYSTEM_PROMPT = ("Solve the problem. You can run Python with the python tool (print what you need). "
                 "Reply with the final answer as a number, without a tool call.")
_INT = re.compile(r"-?\d[\d,_]*")


def last_integer(text: str) -> int | None:
    """The last integer written in `text` ("12,345" and "12_345" read as 12345), or None."""
    found = _INT.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "").replace("_", "")
    return int(digits) if digits not in ("", "-") else None


class PythonToolEnv(ToolEnv):
    """Answer a math question exactly; a sandboxed `python` tool runs programs. Reward 1 for the exact answer."""

    default_max_turns = 6
    uses_sandbox = True

    def __init__(self, families: Sequence[str] | None = None, exec_timeout_s: float = 10.0,
                 system_prompt: str | None = SYSTEM_PROMPT, partial_credit: bool = False,
                 turn_rewards: bool = False, oracle_mistakes: float = 0.0, tool_available: bool = True,
                 **kwargs: Any) -> None:
        names = list(families or DEFAULT_FAMILIES)
        unknown = [f for f in names if f not in FAMILIES]
        if unknown or not names:
            raise ValueError(f"unknown task families {unknown}; choose from {sorted(FAMILIES)}")
        if turn_rewards and not partial_credit:
            raise ValueError("turn_rewards pays the partial credit per turn; set partial_credit=True too")
        if not 0.0 <= oracle_mistakes <= 1.0:
            raise ValueError(f"oracle_mistakes is a probability in [0, 1], got {oracle_mistakes}")
        self.families = names
        self.exec_timeout_s = exec_timeout_s
        self.system_prompt = system_prompt
        self.tool_available = tool_available
        self.partial_credit, self.turn_rewards, self.oracle_mistakes = partial_credit, turn_rewards, oracle_mistakes
        self._ran_answer = False  # a program of this episode printed the answer
        self._paid = 0.0
        self._oracle_guesses: bool | None = None
        super().__init__(**kwargs)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._ran_answer, self._paid, self._oracle_guesses = False, 0.0, None
        return super().reset(seed=seed, options=options)

    def generate_task(self, rng, options: dict[str, Any]) -> PythonTask:
        family = options.get("family") or self.families[int(rng.integers(len(self.families)))]
        if family not in FAMILIES:
            raise ValueError(f"options['family']={family!r} is not one of {sorted(FAMILIES)}")
        return FAMILIES[family](rng)

    def opening_messages(self, task: PythonTask) -> list[Message]:
        return [Message(role="user", content=task.question)]

    @tool
    def python(self, code: str) -> str:
        """Run a Python 3 program in a sandbox and return what it prints (stdout, stderr, exit code).

        Args:
            code: the program; print() the values you want to see.
        """
        if not self.tool_available:
            raise ToolError("python is not available in this episode; answer without it")
        timeout = max(1.0, min(self.exec_timeout_s, self.remaining_s()))
        result = self.sandbox.exec(["python3", "-"], stdin=code, timeout=timeout)
        if result.ok and last_integer(result.stdout) == self.task.answer:
            self._ran_answer = True
        return format_exec(result, timeout)

    def reward_parts(self, final_text: str | None = None) -> dict[str, float]:
        """The partial credit so far: a program that printed the answer; the exact final answer when given."""
        parts = {"ran_answer": 0.5 if self._ran_answer else 0.0}
        if final_text is not None:
            parts["answer"] = 0.5 if last_integer(final_text) == self.task.answer else 0.0
        return parts

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.turn_rewards:  # the program's credit in the turn that ran it, once
            earned = self.reward_parts()["ran_answer"] - self._paid
            self._paid += earned
            reward += earned
        return obs, reward, terminated, truncated, info

    def score(self, final_text: str) -> float:
        if not self.partial_credit:
            return 1.0 if last_integer(final_text) == self.task.answer else 0.0
        parts = self.reward_parts(final_text)
        return parts["answer"] if self.turn_rewards else sum(parts.values())

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Run the task's program once; answer with the last integer it printed. With `oracle_mistakes` = q:
        with probability q (once per episode) it answers at once, without the tool, that it does not know
        (family `mul`: it adds the numbers instead, and answers what that printed)."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        terse = self.system_prompt is None
        if last is not None and last.role == "tool" and last.tool_name == "python" and "\n[" not in last.content \
                and not last.content.startswith(("[", "Error")):  # a clean run's output, not an error
            value = last_integer(last.content)
            if value is not None:
                return self.say(str(value) if terse else f"The answer is {value}.")
        if self._oracle_guesses is None:
            self._oracle_guesses = bool(self.oracle_mistakes > 0 and self.np_random.random() < self.oracle_mistakes)
        if self._oracle_guesses and self.task.family == "mul":  # the wrong operation, the task's own numbers
            return self.say("", [{"name": "python", "arguments": {"code": self.task.code.replace("*", "+")}}])
        if self._oracle_guesses:  # no digits: a made-up number would teach the policy to write random digits
            return self.say("?")
        return self.say("" if terse else "Let me compute it.",
                        [{"name": "python", "arguments": {"code": self.task.code}}])
