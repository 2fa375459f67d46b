"""`ToolEnv`: a Gymnasium environment whose agent talks in chat messages and acts through tools.

    obs, info = env.reset(seed=3)          # obs: the opening messages (dicts: role, content, PNG images)
    obs, reward, terminated, truncated, info = env.step(assistant_message)

* Observation: a list of new messages (`ChatMessages` space). `reset` returns the opening
  messages (system prompt, user task, maybe a target image); `step` returns what the
  environment says back: one tool message per call (text + PNG images), or an error message.
* Action: the assistant's message, as the episode loop (`k3rl.rollout.episode`) passes it: an
  assistant `k3rl.chat.Message` it has already parsed from the sampled tokens, or, when those
  tokens did not parse, the token ids themselves (the env reports the parse error). A plain
  Gymnasium user may also pass decoded text (special tokens by name) or a `ParsedAssistant`
  (`AssistantAction` space).
* Tools: `@tool` methods of the subclass (plus `tools=[...]` functions); `env.tools` is the
  JSON declaration for the chat template. Arguments are validated before a tool runs.
* Reward convention (terminal only, every other step gives 0):
    - an assistant message **without tool calls is the final answer**: the episode
      terminates and the reward is `score(final_text)`;
    - a tool may also end the episode by returning `ToolResult(done=True, reward=r)`;
    - a truncated episode gets reward 0.
* Reward parts: a step that pays a reward says what it is made of, `info["reward_parts"]`
  ({name: value}, summing to the step's reward). `score` may return the parts themselves
  ({"valid_key": 0.25, "exact_value": 0.0}; the reward is their sum); a float score is the
  part "score", a tool that ends the episode the part named after the tool. A subclass that
  adds a reward in its own `step` adds its part too. The episode loop keeps them per turn
  (`metadata["reward_parts"]`) and `k3rl replay` shows them.
* Errors made by the model never raise out of `step`: malformed output (ToolCallParseError),
  an unknown tool, bad arguments or a tool that fails all come back as an error message and
  count as a turn. Infrastructure failures (the sandbox died) do raise, after cleanup.
* Limits: the env truncates after `max_turns` assistant messages (Gymnasium's contract for a
  standalone env). The episode loop owns the chat session and enforces the job's turn, time
  and context limits; `time_budget_s` here only caps how long a tool may still run
  (`remaining_s()`, counted from reset).
* Sandboxes: a subclass with `uses_sandbox = True` gets `self.sandbox`, opened on first use
  (from the injected `sandbox_factory`, else `k3rl.sandboxes.open_sandbox(backend=...)`) and
  released when the episode ends, on `reset`, `close`, an exception, or garbage collection.
* Held-out task splits: `split="train"` draws only tasks whose id hashes outside the held-out
  share `test_fraction`, `split="test"` only those inside it (`task_split(task_id)`), so a job's
  `envs.eval` can measure tasks training never saw; `split="all"` (the default) draws every task.
* Info of a step: turn, tool_calls (name, arguments, index, ok, error), errors, parse_error,
  timings (`Timings`: seconds per phase and per tool: "parse", "tool:<i>:<name>", "sandbox" (inside
  the sandbox's exec/read/write), "sandbox_acquire", whatever a tool adds with `self.timed(...)`,
  "step"), truncated_by, task_id. Reset's info has timings too ("reset", "sandbox_acquire", ...).

A subclass implements `generate_task(rng, options)` (the task: any object; its `id`
attribute, or else `str(task)`, names it), `opening_messages(task)`, `score(final_text)` and,
for `k3rl envs check` and SFT demonstrations, `oracle(history)`.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from k3rl.chat import ChatTemplate, Message, ToolCallParseError
from k3rl.envs.actions import assistant_message, assistant_text
from k3rl.envs.spaces import AssistantAction, ChatMessages, message_dict
from k3rl.envs.timings import Timings
from k3rl.envs.tools import Tool, ToolArgumentError, ToolError, ToolResult, collect_tools
from k3rl.images import png_size
from k3rl.sandboxes import PathEscapeError, RenderError, SandboxError, SandboxFileError, open_sandbox
from k3rl.types import ToolCall

# Sandbox errors the model caused (a bad path, a missing file, drawing code that fails) come
# back to it as tool errors; any other SandboxError (the sandbox died, the backend failed) is
# an infrastructure failure that ends the episode with the exception.
MODEL_SANDBOX_ERRORS = (PathEscapeError, SandboxFileError, RenderError)


class EpisodeNotActiveError(RuntimeError):
    """`step` was called before `reset` or after the episode ended."""


class SandboxSetupError(SandboxError):
    """`setup_sandbox` failed: an infrastructure failure (never reported to the model), whatever the cause."""


class NoOracleError(RuntimeError):
    """The environment has no scripted oracle policy."""


SPLITS = ("all", "train", "test")


def task_split(task_id: str, test_fraction: float) -> str:
    """"test" for the share `test_fraction` of task ids (by a hash of the id), else "train"."""
    h = int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=8).digest(), "big") / 2**64
    return "test" if h < test_fraction else "train"


class ToolEnv(gym.Env, abc.ABC):
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    default_max_turns: int = 8
    uses_sandbox: bool = False
    system_prompt: str | None = None
    declare_tools_by_default: bool = True  # tiny-model envs name their tool in the prompt instead

    def __init__(self, *, max_turns: int | None = None, time_budget_s: float = 600.0,
                 template: ChatTemplate | None = None,
                 thinking: bool = False, tools: Sequence[Tool | Callable[..., Any]] = (),
                 sandbox_factory: Callable[[], Any] | None = None,
                 sandbox_release: Callable[[Any], None] | None = None,
                 sandbox_backend: str = "auto", sandbox_limits: dict[str, Any] | None = None,
                 max_tool_output_chars: int = 4000, render_mode: str | None = None,
                 split: str = "all", test_fraction: float = 0.25, declare_tools: bool | None = None) -> None:
        max_turns = self.default_max_turns if max_turns is None else max_turns
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        if time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 seconds, got {time_budget_s}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} is not one of {self.metadata['render_modes']}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction is the held-out share of tasks, in (0, 1); got {test_fraction}")
        self.split, self.test_fraction = split, test_fraction
        self.declare_tools = self.declare_tools_by_default if declare_tools is None else bool(declare_tools)
        self.max_turns = max_turns
        self.time_budget_s = float(time_budget_s)
        self.template = template or ChatTemplate(thinking=thinking)
        self.max_tool_output_chars = max_tool_output_chars
        self.render_mode = render_mode
        self.sandbox_backend = sandbox_backend
        self.sandbox_limits = dict(sandbox_limits or {})
        self._sandbox_factory = sandbox_factory
        self._sandbox_release = sandbox_release
        self._sandbox: Any = None
        self._sandbox_busy_seen = 0.0
        self._timings = Timings()  # of the current step (or reset): tools add phases with `timed`

        declared = collect_tools(self) + [t if isinstance(t, Tool) else Tool(t, is_method=False) for t in tools]
        self._tools: dict[str, Tool] = {}
        for t in declared:
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
            self._tools[t.name] = t
        self._tool_schemas = [t.schema() for t in self._tools.values()]

        self.observation_space = ChatMessages()
        self.action_space = AssistantAction()

        self.task: Any = None
        self.history: list[Message] = []
        self._turn = 0
        self._active = False
        self._t0 = 0.0

    # -- to implement --------------------------------------------------------------------
    @abc.abstractmethod
    def generate_task(self, rng, options: dict[str, Any]) -> Any:
        """A task drawn from `rng` (deterministic given the seed); named by its `id` attribute, else `str(task)`."""

    @abc.abstractmethod
    def opening_messages(self, task: Any) -> list[Message]:
        """The messages that open an episode on `task` (the user's request, images...)."""

    @abc.abstractmethod
    def score(self, final_text: str) -> float | Mapping[str, float]:
        """Terminal reward of the final answer (an assistant message without tool calls), or its parts
        ({name: value}: the reward is their sum, and `k3rl replay` shows each)."""

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """A scripted policy: the next assistant message (as action text) given the conversation."""
        raise NoOracleError(f"{type(self).__name__} defines no scripted oracle; override ToolEnv.oracle(history)")

    def setup_sandbox(self, sandbox: Any) -> None:
        """Prepare a freshly acquired sandbox for the current task (write files...)."""

    # -- public helpers --------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        """JSON declarations of the tools, for `ChatTemplate.render(..., tools=env.tools)`; [] when the env
        does not declare them (`declare_tools=False`: the prompt names the tool, ~300 tokens saved)."""
        return copy.deepcopy(self._tool_schemas) if self.declare_tools else []

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    @property
    def turn(self) -> int:
        return self._turn

    @property
    def active(self) -> bool:
        return self._active

    @property
    def task_id(self) -> str:
        return str(getattr(self.task, "id", self.task))

    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0 if self._active else 0.0

    def remaining_s(self) -> float:
        return max(0.0, self.time_budget_s - self.elapsed_s())

    def say(self, content: str = "", tool_calls: Sequence[ToolCall | dict] = (), thinking: str | None = None) -> str:
        """The action text of an assistant message with this content and these calls (for oracles)."""
        if self.template.thinking and thinking is None:
            thinking = ""
        return assistant_text(self.template, content, tool_calls, thinking)

    # -- sandbox -----------------------------------------------------------------------------
    @property
    def sandbox(self) -> Any:
        """This episode's sandbox, acquired on first use and released when the episode ends."""
        if not self.uses_sandbox:
            raise AttributeError(f"{type(self).__name__} does not use a sandbox (uses_sandbox = False)")
        if self._sandbox is None:
            with self.timed("sandbox_acquire"):  # a warm pool's hand-out, or a start; then the task's files
                if self._sandbox_factory is not None:
                    sb = self._sandbox_factory()
                else:
                    sb = open_sandbox(backend=self.sandbox_backend, **self.sandbox_limits)
            self._sandbox, self._sandbox_busy_seen = sb, getattr(sb, "busy_s", 0.0)
            try:
                self.setup_sandbox(sb)
            except Exception as e:
                self._release_sandbox()
                raise SandboxSetupError(f"{type(self).__name__}.setup_sandbox failed: {type(e).__name__}: {e}") from e
            except BaseException:
                self._release_sandbox()
                raise
        return self._sandbox

    @property
    def has_sandbox(self) -> bool:
        return self._sandbox is not None

    @contextlib.contextmanager
    def timed(self, phase: str):
        """Add the block's wall seconds to `phase` of the current step's (or reset's) `info["timings"]`, e.g.
        `with self.timed("render"):` in a tool that draws a screen."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timings[phase] = self._timings.get(phase, 0.0) + time.perf_counter() - t0

    def _account_sandbox(self) -> None:
        """The sandbox's busy seconds since last looked: this step's `sandbox` timing."""
        busy = getattr(self._sandbox, "busy_s", None)
        if busy is not None:
            self._timings["sandbox"] = self._timings.get("sandbox", 0.0) + busy - self._sandbox_busy_seen
            self._sandbox_busy_seen = busy

    def _release_sandbox(self) -> None:
        self._account_sandbox()
        sb, self._sandbox = self._sandbox, None
        if sb is None:
            return
        if self._sandbox_release is not None:
            self._sandbox_release(sb)
        else:
            sb.close()

    # -- Gymnasium API -----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._end_episode()
        t_reset, self._timings = time.perf_counter(), Timings()
        try:
            self.task = self._draw_task(dict(options or {}))
            opening = list(self.opening_messages(self.task))
        except BaseException:
            self._release_sandbox()  # opening_messages may have needed one (e.g. to render a target)
            raise
        if self.system_prompt:
            opening.insert(0, Message(role="system", content=self.system_prompt))
        self.history = list(opening)
        self._turn = 0
        self._t0 = time.monotonic()
        self._active = True
        self._account_sandbox()
        self._timings["reset"] = time.perf_counter() - t_reset
        info = {"task_id": self.task_id, "tools": self.tools, "max_turns": self.max_turns, "timings": self._timings}
        return [message_dict(m) for m in opening], info

    def _draw_task(self, options: dict[str, Any]) -> Any:
        """The next task of this env's split (tasks of the other split are drawn and passed over)."""
        for _ in range(10_000):
            task = self.generate_task(self.np_random, options)
            if self.split == "all" or task_split(str(getattr(task, "id", task)), self.test_fraction) == self.split:
                return task
        raise RuntimeError(f"{type(self).__name__}: no task of split {self.split!r} in 10000 draws with options "
                           f"{options}; the options may pin a task of the other split, or the task space is too small")

    def step(self, action: Any):
        if not self._active:
            raise EpisodeNotActiveError(
                "step() needs an active episode: call reset() first (and again after terminated/truncated)"
            )
        t_step = time.perf_counter()
        self._turn += 1
        timings = self._timings = Timings()
        info: dict[str, Any] = {"turn": self._turn, "task_id": self.task_id, "tool_calls": [], "errors": [],
                                "parse_error": None, "timings": timings, "truncated_by": None}
        reward, terminated, truncated = 0.0, False, False
        new: list[Message] = []
        try:
            t = time.perf_counter()
            try:
                parsed = assistant_message(self.template, action)
            except ToolCallParseError as e:
                parsed = None
                info["parse_error"] = str(e)
                info["errors"].append(str(e))
                self.history.append(Message(role="assistant", content=self.template.tok.decode(e.ids)))
            timings["parse"] = time.perf_counter() - t
            if parsed is None:
                new.append(Message(role="user", content=(
                    f"Error: your message could not be parsed ({info['parse_error']}). "
                    "Write the response, then optionally a tools channel with calls, then close the message.")))
            else:
                calls = [c.model_copy(update={"index": i, "id": f"t{self._turn}c{i}"})
                         for i, c in enumerate(parsed.tool_calls, start=1)]
                self.history.append(Message(role="assistant", content=parsed.content, thinking=parsed.thinking,
                                            tool_calls=calls))
                if not calls:
                    t = time.perf_counter()
                    scored = self.score(parsed.content)  # the reward, or its parts
                    info["reward_parts"] = ({k: float(v) for k, v in scored.items()} if isinstance(scored, Mapping)
                                            else {"score": float(scored)})
                    reward, terminated = sum(info["reward_parts"].values()), True
                    timings["score"] = time.perf_counter() - t
                for call in calls:
                    msg, result = self._run_tool(call, timings, info)
                    new.append(msg)
                    if result.done:
                        reward, terminated = float(result.reward), True
                        info["reward_parts"] = {call.name: reward}
                        break
            self.history.extend(new)
            if not terminated and self._turn >= self.max_turns:
                truncated, info["truncated_by"] = True, "max_turns"
            if terminated or truncated:
                self._end_episode()
        except BaseException:
            self._end_episode()
            raise
        self._account_sandbox()
        timings["step"] = time.perf_counter() - t_step
        return [message_dict(m) for m in new], reward, terminated, truncated, info

    def _run_tool(self, call: ToolCall, timings: Timings, info: dict[str, Any]) -> tuple[Message, ToolResult]:
        t = time.perf_counter()
        tool = self._tools.get(call.name)
        record: dict[str, Any] = {"name": call.name, "arguments": dict(call.arguments), "index": call.index,
                                  "id": call.id, "ok": True, "error": None}
        if tool is None:
            result = ToolResult(f"Error: unknown tool {call.name!r}. Available tools: {', '.join(self._tools)}.",
                                error=True)
        elif call.raw_arguments is not None:  # written, but not as JSON: tell the model, run nothing
            result = ToolResult(f"Error: the arguments of {call.name} are not valid JSON: {call.raw_arguments[:200]!r}. "
                                "Write them as one JSON object.", error=True)
        else:
            try:
                kwargs = tool.validate(call.arguments)
                result = ToolResult.coerce(tool.fn(**kwargs))
            except (ToolArgumentError, ToolError) as e:
                result = ToolResult(f"Error: {e}", error=True)
            except MODEL_SANDBOX_ERRORS as e:
                result = ToolResult(f"Error: {call.name} failed: {e}", error=True)
            except SandboxError:
                raise
            except Exception as e:  # the tool failed on the model's input: tell the model
                result = ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", error=True)
        text = result.text
        if len(text) > self.max_tool_output_chars:
            cut = self.max_tool_output_chars
            text = text[:cut] + f"\n[output truncated: {cut} of {len(result.text)} characters shown]"
        if result.error:
            record["ok"], record["error"] = False, result.text
            info["errors"].append(result.text)
        info["tool_calls"].append(record)
        timings[f"tool:{call.index}:{call.name}"] = time.perf_counter() - t
        msg = Message(role="tool", content=text, images=result.images, tool_name=call.name, tool_index=call.index)
        return msg, result

    def _end_episode(self) -> None:
        self._active = False
        self._release_sandbox()

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self.transcript()
        return None

    def transcript(self, history: Sequence[Message | dict] | None = None) -> str:
        """Readable text of the conversation (images shown as [image WxH])."""
        lines = []
        for m in self._messages(history):
            head = m.role if m.role != "tool" else f"tool {m.tool_name}#{m.tool_index}"
            body = "".join(f"[image {png_size(p)[0]}x{png_size(p)[1]}] " for p in m.images) + m.content
            for c in m.tool_calls:
                body += f"\n  -> {c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
            lines.append(f"[{head}] {body}")
        return "\n".join(lines)

    def _messages(self, history: Sequence[Message | dict] | None) -> list[Message]:
        if history is None:
            return list(self.history)
        return [m if isinstance(m, Message) else Message.model_validate(m) for m in history]

    def close(self) -> None:
        self._end_episode()

    def __del__(self) -> None:
        try:
            if getattr(self, "_sandbox", None) is not None:
                self._release_sandbox()
        except Exception:
            pass


def registered_entry_point(env_id: str) -> Any:
    """What `env_id` is registered with, loaded: a class or a factory function (Gymnasium's error when unknown)."""
    entry = gym.spec(env_id).entry_point
    return load_env_creator(entry) if isinstance(entry, str) else entry


def is_tool_env(env_id: str) -> bool:
    """Whether `env_id` is registered with a ToolEnv subclass (the class itself or "module:Class")."""
    cls = registered_entry_point(env_id)
    return isinstance(cls, type) and issubclass(cls, ToolEnv)
