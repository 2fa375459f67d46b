"""`k3rl/CodeFix-v0`: a small repository with a bug and failing tests, inside a sandbox.

Tools: `bash`, `read_file`, `write_file`, `str_replace`, `run_tests` (the visible tests).
The episode ends when the assistant replies without a tool call; then hidden tests (the
same contract, more cases) are written into the sandbox and run. Reward 1 when they all
pass, else 0.

Grading happens in a fresh sandbox: the regular files the agent left under /work are copied into
it (at most `MAX_JUDGED_FILES` files and `MAX_JUDGED_BYTES`; symlinks are not followed), so no
process the agent started (a daemon that would rewrite the hidden tests as they land) runs there.
It runs `python3 -I -m pytest --noconftest -c <hidden>/pytest.ini <hidden>` so files the agent
planted in the work dir (conftest.py, pytest.ini, sitecustomize.py) cannot change how the hidden
tests run; the module under test is imported from /work.

`reset(options={"bug": "clamp_bound"})` picks a bug of the catalogue (code_fix_tasks.BUGS);
`bugs=[...]` restricts the set.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.code_fix_tasks import BUGS, CodeFixTask
from k3rl.envs.sandboxed import format_exec, read_text, write_text
from k3rl.envs.tools import ToolError, tool
from k3rl.sandboxes import open_sandbox

PYTEST = "python3 -m pytest -q -p no:cacheprovider"
MAX_JUDGED_FILES, MAX_JUDGED_BYTES = 500, 8 << 20  # what a repository fix may leave under /work


class CodeFixEnv(ToolEnv):
    """Fix the bug so the tests pass. Reward 1 when the hidden tests pass after the final answer."""

    default_max_turns = 12
    uses_sandbox = True
    system_prompt = ("You are in a repository at /work whose tests fail. Use the tools to find and fix the bug. "
                     "When you are done, reply without a tool call.")

    def __init__(self, bugs: Sequence[str] | None = None, exec_timeout_s: float = 30.0, **kwargs: Any) -> None:
        names = list(bugs or BUGS)
        unknown = [b for b in names if b not in BUGS]
        if unknown or not names:
            raise ValueError(f"unknown bugs {unknown}; choose from {sorted(BUGS)}")
        self.bugs = names
        self.exec_timeout_s = exec_timeout_s
        self.last_hidden_output = ""
        super().__init__(**kwargs)

    def generate_task(self, rng, options: dict[str, Any]) -> CodeFixTask:
        name = options.get("bug") or self.bugs[int(rng.integers(len(self.bugs)))]
        if name not in BUGS:
            raise ValueError(f"options['bug']={name!r} is not one of {sorted(BUGS)}")
        return BUGS[name](rng)

    def opening_messages(self, task: CodeFixTask) -> list[Message]:
        listing = "\n".join(sorted(task.files))
        return [Message(role="user", content=f"The tests of this repository fail. Files:\n{listing}\n"
                                             "Fix the bug so that `python3 -m pytest -q tests` passes.")]

    def setup_sandbox(self, sandbox: Any) -> None:
        for path, content in self.task.files.items():
            sandbox.write_file(path, content)

    def _timeout(self) -> float:
        return max(1.0, min(self.exec_timeout_s, self.remaining_s()))

    # -- tools -------------------------------------------------------------------------------
    @tool
    def bash(self, command: str) -> str:
        """Run a shell command in the repository (cwd /work); returns stdout, stderr and the exit code.

        Args:
            command: the command line, e.g. "ls -la" or "grep -n def *.py".
        """
        timeout = self._timeout()
        return format_exec(self.sandbox.exec(command, timeout=timeout), timeout)

    @tool
    def read_file(self, path: str) -> str:
        """Return the content of a file of the repository.

        Args:
            path: path relative to /work, e.g. "stats.py".
        """
        return read_text(self.sandbox, path)

    @tool
    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file of the repository.

        Args:
            path: path relative to /work.
            content: the complete new content.
        """
        write_text(self.sandbox, path, content)
        return f"wrote {len(content.encode())} bytes to {path}"

    @tool
    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of `old` in a file by `new`.

        Args:
            path: path relative to /work.
            old: the exact text to replace; it must occur exactly once.
            new: the replacement text.
        """
        text = read_text(self.sandbox, path)
        count = text.count(old) if old else 0
        if count != 1:
            raise ToolError(f"`old` occurs {count} times in {path}; it must occur exactly once "
                            "(copy it exactly, with enough surrounding lines to be unique)")
        write_text(self.sandbox, path, text.replace(old, new, 1))
        return f"replaced 1 occurrence in {path}"

    @tool
    def run_tests(self) -> str:
        """Run the repository's tests (python3 -m pytest -q tests) and return the report."""
        timeout = self._timeout()
        return format_exec(self.sandbox.exec(f"{PYTEST} tests", timeout=timeout), timeout)

    # -- reward ------------------------------------------------------------------------------
    def score(self, final_text: str) -> float:
        files = self._work_files()
        if isinstance(files, str):  # too much left in /work to judge
            self.last_hidden_output = files
            return 0.0
        judge = self._sandbox_factory() if self._sandbox_factory is not None else \
            open_sandbox(backend=self.sandbox_backend, **self.sandbox_limits)
        try:
            with self.timed("judge"):
                for path, data in files.items():
                    judge.write_file(path, data)
                hidden = f".k3rl-hidden-{uuid.uuid4().hex[:8]}"
                judge.write_file(f"{hidden}/test_hidden.py", self.task.hidden_tests)
                judge.write_file(f"{hidden}/pytest.ini", "[pytest]\n")
                result = judge.exec(
                    f"python3 -I -m pytest -q -p no:cacheprovider --noconftest -c {hidden}/pytest.ini {hidden}",
                    timeout=max(5.0, self.exec_timeout_s),
                )
        finally:
            if self._sandbox_release is not None:
                self._sandbox_release(judge)
            else:
                judge.close()
        self.last_hidden_output = format_exec(result, self.exec_timeout_s)
        return 1.0 if result.ok else 0.0

    def _work_files(self) -> dict[str, bytes] | str:
        """The regular files under /work (paths relative to it) as the agent left them, or why not."""
        listing = self.sandbox.exec("find . -type f -printf '%s %P\\0'", timeout=max(5.0, self.exec_timeout_s))
        entries = [e.split(" ", 1) for e in listing.stdout.split("\0") if " " in e]
        total = sum(int(size) for size, _ in entries)
        if len(entries) > MAX_JUDGED_FILES or total > MAX_JUDGED_BYTES:
            return (f"not judged: /work holds {len(entries)} files of {total} bytes, more than a repository fix "
                    f"leaves ({MAX_JUDGED_FILES} files, {MAX_JUDGED_BYTES} bytes)")
        return {path: self.sandbox.read_file(path) for _, path in entries}

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """read_file -> str_replace (the known fix) -> run_tests -> final answer."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        module = self.task.module
        old, new = self.task.fix
        if last is None or last.role != "tool":
            return self.say(f"Let me look at {module}.", [{"name": "read_file", "arguments": {"path": module}}])
        if last.tool_name == "read_file":
            return self.say("Found the bug; fixing it.",
                            [{"name": "str_replace", "arguments": {"path": module, "old": old, "new": new}}])
        if last.tool_name == "str_replace":
            return self.say("Running the tests.", [{"name": "run_tests", "arguments": {}}])
        return self.say(f"Fixed the bug in {module}; the tests pass.")
