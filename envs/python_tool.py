"""`k3rl/PythonTool-v0`: arithmetic and word problems, solved with a Python interpreter in a sandbox.

The numbers are large enough that computing in the head is unreliable, so the useful policy
is: write a short program, call `python(code=...)`, read the printed result, answer.
Reward 1 when the final answer's last integer equals the exact answer (commas and
underscores inside numbers are ignored), else 0.

Task families (generated from the seed): products and sums of big numbers, modular
powers, sums of ranges, digit sums of powers, counting multiples, and a few word problems.
Each task carries the program the oracle sends to the interpreter.
`reset(options={"family": "modpow"})` picks a family; `families=[...]` restricts the set.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.sandboxed import format_exec
from k3rl.envs.tools import tool


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


FAMILIES: dict[str, Callable[[Any], PythonTask]] = {
    "product": _product, "modpow": _modpow, "range_sum": _range_sum, "digit_sum": _digit_sum,
    "multiples": _multiples, "apples": _apples, "savings": _savings, "trains": _trains,
}
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
    system_prompt = ("Solve the problem. You can run Python with the python tool (print what you need). "
                     "Reply with the final answer as a number, without a tool call.")

    def __init__(self, families: Sequence[str] | None = None, exec_timeout_s: float = 10.0, **kwargs: Any) -> None:
        names = list(families or FAMILIES)
        unknown = [f for f in names if f not in FAMILIES]
        if unknown or not names:
            raise ValueError(f"unknown task families {unknown}; choose from {sorted(FAMILIES)}")
        self.families = names
        self.exec_timeout_s = exec_timeout_s
        super().__init__(**kwargs)

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
        timeout = max(1.0, min(self.exec_timeout_s, self.remaining_s()))
        result = self.sandbox.exec(["python3", "-"], stdin=code, timeout=timeout)
        return format_exec(result, timeout)

    def score(self, final_text: str) -> float:
        return 1.0 if last_integer(final_text) == self.task.answer else 0.0

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Run the task's program once; answer with the last integer it printed."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        if last is not None and last.role == "tool" and last.tool_name == "python":
            value = last_integer(last.content)
            if value is not None:
                return self.say(f"The answer is {value}.")
        return self.say("Let me compute it.", [{"name": "python", "arguments": {"code": self.task.code}}])
