"""The episode loop: one episode, token in / token out, whoever plays the assistant.

    make_env -> reset -> render the opening -> [generate -> parse -> env.step(message)
    -> render what the env said back]* -> Trajectory

Every episode of k3rl runs here, with a different `generate` behind it: the inference pool
(rollout workers), or a scripted policy (`scripted_generate`: the env's oracle for SFT
demonstrations and `k3rl envs check`, the recorded tokens for `k3rl replay --re-execute`).

Token in, token out: the loop owns the chat session. The sampled ids are appended exactly as
the engine returned them (with their behaviour log-probs and policy versions) and parsed
once; the env gets the parsed assistant `Message` (or, when the ids did not parse, the ids, so
the env can tell the model what was wrong). Everything the env says back is rendered once by
the template and appended with loss mask 0. History is never re-tokenised.

The limits are the loop's: `max_turns` assistant messages, `max_context_tokens` of the whole
conversation, `time_budget_s` of wall clock for the episode (every `generate` and `step` runs
under that deadline).

How an episode ends:
  * terminated: the env says so (a final answer, a tool that ends it); the env's reward;
  * truncated (the model's doing; trained on): out of turns, the context full, a message cut
    by the per-turn token limit, or the env's own truncation. `metadata["truncated_by"]` is
    "max_turns", "context", "max_tokens" (or the env's `info["truncated_by"]`, else "env").
    Truncations by the loop get reward 0;
  * failed (never trained on): `error` = "<ExceptionType>: message", reward 0,
    `metadata["failed_at"]` one of "make_env", "reset", "context" (the first prompt leaves no
    room for a reply), "generate" (engine error or death), "step" (a tool's infrastructure, a
    dead sandbox), "time_budget"; a short `metadata["traceback"]`. The loop never raises for
    an episode's failure; cancellation propagates, after the env is closed.

Sampling seeds: every request gets a seed derived from the episode (`request_seed`), so the
same job, run again, samples the same tokens.

The end of the module builds a job's episodes: the env and chat template of a `JobConfig`
(`make_env`, `make_template`); the start-of-job checks and the SFT warm start's oracle
demonstrations are in `job_start.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import math
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium

import k3rl.envs  # noqa: F401  (registers k3rl/* and the entry points)
from k3rl.chat import ChatSession, ChatTemplate, Message, ToolCallParseError
from k3rl.config import JobConfig
from k3rl.envs.actions import action_to_ids
from k3rl.envs.base import NoOracleError, is_tool_env, registered_entry_point
from k3rl.images import num_image_tokens
from k3rl.rollout.context import SUMMARY_REQUEST, Compactor, asks_for_summary, start_segment
from k3rl.rollout.engine import GenerationResult
from k3rl.tokenizer import load_tokenizer
from k3rl.types import SamplingParams, Trajectory, Turn

Generate = Callable[..., Awaitable[Any]]
NO_LIMIT = 1 << 30


@dataclass
class EpisodeSpec:
    """What to run. `id` is stable across retries (the buffer's dedup key); `options` go to `reset`;
    `sampling` overrides fields of the job's SamplingParams for this episode (e.g. {"temperature": 0.0}:
    the greedy episodes of the held-out evaluation)."""

    id: str
    env_id: str
    seed: int | None
    group_id: str = ""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    issued_version: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)


class ContextLimitError(ValueError):
    """The first prompt leaves no room under max_context_tokens for the model's reply."""


class TimeBudgetError(TimeoutError):
    """The episode ran out of its wall-clock budget."""


class GenerationError(RuntimeError):
    """The engine ended a request without a message (e.g. aborted)."""


def request_seed(spec: EpisodeSpec, turn: int, base: int | None = None) -> int:
    """The sampling seed of one request: a hash of (`base`, env, episode seed, the episode's
    name within its group, turn). The run's name is left out (episode ids start with it), so
    the same job run again, under any name, samples the same tokens; `base` (a seed set in
    the sampling params) shifts every request's seed."""
    member = spec.id[len(spec.group_id):] if spec.group_id and spec.id.startswith(spec.group_id) else spec.id
    key = f"{base}|{spec.env_id}|{spec.seed}|{member}|{turn}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def observed_messages(obs: Any) -> list[Message]:
    """The messages of an observation: a list of message dicts / Messages (or one, or {"messages": [...]})."""
    if isinstance(obs, dict) and "messages" in obs:
        obs = obs["messages"]
    if obs is None:
        return []
    if isinstance(obs, (dict, Message)):
        obs = [obs]
    out = []
    for m in obs:
        if not isinstance(m, (dict, Message)):
            raise TypeError(f"the environment returned a {type(m).__name__} where a chat message (dict or "
                            "k3rl.chat.Message) was expected")
        out.append(m if isinstance(m, Message) else Message.model_validate(m))
    return out


def open_session(template: ChatTemplate, env: Any, obs: Any) -> tuple[ChatSession, list[Turn], list[bytes]]:
    """The chat session of an episode's opening (tools declared, opening messages, generation
    prefix), its turns and its images."""
    session = template.session(tools=getattr(env.unwrapped, "tools", None) or None)
    turns, images = [], []
    for m in observed_messages(obs):
        start = len(session.rendered)
        session.add(m)
        images.extend(m.images)
        turns.append(Turn(role=m.role, text=m.content, images=m.images, tool_name=m.tool_name,
                          tool_index=m.tool_index, start=start, end=len(session.rendered)))
    session.add_generation_prompt()
    return session, turns, images


async def run_episode(make_env: Callable[[], Any], spec: EpisodeSpec, generate: Generate, template: ChatTemplate,
                      sampling: SamplingParams, *, max_turns: int, max_context_tokens: int,
                      time_budget_s: float = math.inf, record_routing: bool = False,
                      context: Any = None) -> Trajectory:
    """One episode of the env `make_env()` makes, against `generate(token_ids, sampling, images=,
    key=, group_key=)`. Never raises for the episode's failure (see the module doc). `context`
    (a k3rl.config.ContextSection) compacts the context when it nears `max_context_tokens`."""
    t0 = time.monotonic()
    deadline = t0 + time_budget_s
    traj = Trajectory(id=spec.id, env_id=spec.env_id, seed=spec.seed, group_id=spec.group_id, prompt_ids=[],
                      routed_experts=[] if record_routing else None,
                      metadata={"issued_version": spec.issued_version, "env_kwargs": dict(spec.env_kwargs),
                                **({"sampling": dict(spec.sampling)} if spec.sampling else {})})
    timings = {"generate_s": 0.0, "env_s": 0.0}

    async def within(aw: Awaitable) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            aw.close()
            raise TimeBudgetError(f"the episode's time budget of {time_budget_s:g}s is used up")
        try:
            return await asyncio.wait_for(aw, None if math.isinf(left) else left)
        except TimeoutError:
            if time.monotonic() < deadline:
                raise  # not ours: the awaited call's own timeout
            raise TimeBudgetError(f"the episode's time budget of {time_budget_s:g}s ran out") from None

    env, stage = None, "make_env"
    try:
        env = await within(asyncio.to_thread(make_env))
        stage = "reset"
        e0 = time.monotonic()
        obs, info = await within(asyncio.to_thread(env.reset, seed=spec.seed, options=spec.options or None))
        timings["env_s"] += time.monotonic() - e0
        _add_env_timings(timings, info)
        traj.task_id = str((info or {}).get("task_id", ""))
        if getattr(env.unwrapped, "is_agent_env", False):  # k3rl/Agent-v0: the user's agent drives the model
            stage = "agent"
            # lazy: the agent path serves HTTP (FastAPI, uvicorn), which no other episode needs to import
            from k3rl.rollout.agent_episode import run_agent

            await run_agent(env.unwrapped, traj, spec, generate, template, sampling, max_context_tokens, within,
                            timings, lambda call: request_seed(spec, call, sampling.seed))
            return traj
        session, traj.turns, images = open_session(template, env, obs)
        traj.prompt_ids = list(session.rendered.ids)
        compactor, seg_start = None, 0  # seg_start: where the current context segment begins in token_ids
        if context is not None and context.strategy != "none":
            compactor = Compactor(context, template, max_context_tokens, getattr(env.unwrapped, "tools", None))
            compactor.open(observed_messages(obs))
        if len(traj.prompt_ids) >= max_context_tokens:
            stage = "context"
            raise ContextLimitError(f"the first prompt is {len(traj.prompt_ids)} tokens, "
                                    f"{'at' if len(traj.prompt_ids) == max_context_tokens else 'over'} "
                                    f"max_context_tokens={max_context_tokens}: no room for a reply")
        sampling = SamplingParams.model_validate({**sampling.model_dump(), **spec.sampling})  # the episode's own
        sampling = sampling.model_copy(update={
            "stop_token_ids": sorted({*sampling.stop_token_ids, template.stop_token_id}),
            "return_routed_experts": record_routing})
        prefix = len(template.generation_prefix())
        truncated_by = "max_turns"
        for turn in range(max_turns):
            stage = "generate"
            n = len(traj.prompt_ids) + len(traj.completion_ids)
            request = sampling.model_copy(update={"max_tokens": min(sampling.max_tokens,
                                                                    max_context_tokens - (n - seg_start)),
                                                  "seed": request_seed(spec, turn, sampling.seed)})
            g0 = time.monotonic()
            out = await within(generate(traj.token_ids[seg_start:], request, images=images or None, key=spec.id,
                                        group_key=spec.group_id if turn == 0 and spec.group_id else None))
            timings["generate_s"] += time.monotonic() - g0
            finish = getattr(out, "finish_reason", "stop")
            if finish not in ("stop", "length"):
                raise GenerationError(f"the engine ended the request with finish_reason {finish!r}")
            ids = [int(i) for i in out.token_ids]
            _append_generated(traj, ids, out, record_routing)
            session.add_generated(ids)
            said = Turn(role="assistant", start=n - prefix, end=n + len(ids), duration_s=time.monotonic() - g0,
                        segment=len(traj.segment_starts))
            traj.turns.append(said)
            if finish == "length":
                said.text = template.tok.decode(ids)
                said.error = f"cut at {request.max_tokens} tokens, before <|end_of_msg|>"
                truncated_by = "max_tokens" if request.max_tokens == sampling.max_tokens else "context"
                break
            try:
                action: Any = template.parse_assistant(ids).to_message()
                said.text, said.thinking, said.tool_calls = action.content, action.thinking, action.tool_calls
            except ToolCallParseError as e:  # the env gets the ids and tells the model what was wrong
                action, said.text, said.error = ids, template.tok.decode(ids), str(e)
            if compactor is not None:
                compactor.said(ids, said)
            stage = "step"
            e0 = time.monotonic()
            obs, reward, terminated, truncated, info = await within(asyncio.to_thread(env.step, action))
            timings["env_s"] += time.monotonic() - e0
            _add_env_timings(timings, info)
            said.reward = float(reward)
            traj.reward += float(reward)
            if (info or {}).get("reward_parts"):  # what the step's reward is made of (envs/base.py), for replay
                traj.metadata.setdefault("reward_parts", []).append(
                    {"turn": len(traj.turns) - 1, "parts": {k: float(v) for k, v in info["reward_parts"].items()}})
            if (info or {}).get("parse_error"):  # a malformed message: the format guard's signal
                traj.metadata["parse_errors"] = traj.metadata.get("parse_errors", 0) + 1
            errors = {c.get("index"): c.get("error") for c in (info or {}).get("tool_calls", [])}
            tool_s = (info or {}).get("timings") or {}  # "tool:<index>:<name>" -> seconds
            for m in observed_messages(obs):
                start, end = traj.append(session.add(m).ids, generated=False)
                images.extend(m.images)
                traj.turns.append(Turn(role=m.role, text=m.content, images=m.images, tool_name=m.tool_name,
                                       tool_index=m.tool_index, start=start, end=end, segment=len(traj.segment_starts),
                                       error=errors.get(m.tool_index) if m.role == "tool" else None,
                                       duration_s=float(tool_s.get(f"tool:{m.tool_index}:{m.tool_name}", 0.0))
                                       if m.role == "tool" else 0.0))
                if compactor is not None:
                    compactor.replied(m)
            if terminated or truncated:
                traj.terminated, traj.truncated = bool(terminated), bool(truncated)
                if truncated:
                    traj.metadata["truncated_by"] = (info or {}).get("truncated_by") or "env"
                break
            if compactor is not None and compactor.due(len(traj.token_ids) - seg_start + prefix):
                summary = None
                if compactor.strategy == "summarize":  # a summarisation turn, sampled and trained like any
                    stage = "generate"
                    asking = Message(role="user", content=compactor.request_text)
                    start, _ = traj.append(session.add(asking).ids, generated=False)
                    traj.turns.append(Turn(role="user", text=compactor.request_text, start=start, end=len(traj.token_ids),
                                           segment=len(traj.segment_starts), compaction="summary_request"))
                    traj.append(session.add_generation_prompt().ids, generated=False)
                    n = len(traj.token_ids)
                    request = sampling.model_copy(update={
                        "max_tokens": min(sampling.max_tokens, max_context_tokens - (n - seg_start)),
                        "seed": request_seed(spec, -1 - turn, sampling.seed)})
                    g0 = time.monotonic()
                    out = await within(generate(traj.token_ids[seg_start:], request, images=images or None, key=spec.id))
                    timings["generate_s"] += time.monotonic() - g0
                    if getattr(out, "finish_reason", "stop") not in ("stop", "length"):
                        raise GenerationError(f"the engine ended the request with finish_reason {out.finish_reason!r}")
                    ids = [int(i) for i in out.token_ids]
                    _append_generated(traj, ids, out, record_routing)
                    try:
                        summary = template.parse_assistant(ids).to_message().content
                    except ToolCallParseError:  # cut, or malformed: the text as written
                        summary = template.tok.decode(ids)
                    traj.turns.append(Turn(role="assistant", text=summary, start=n - prefix, end=n + len(ids),
                                           duration_s=time.monotonic() - g0, segment=len(traj.segment_starts),
                                           compaction="summary"))
                session, images, seg_start = start_segment(traj, compactor, summary)
            if len(traj.token_ids) - seg_start + prefix >= max_context_tokens:
                truncated_by = "context"
                break
            traj.append(session.add_generation_prompt().ids, generated=False)
        if not (traj.terminated or traj.truncated):
            traj.truncated, traj.reward = True, 0.0
            traj.metadata["truncated_by"] = truncated_by
    except Exception as e:  # an episode's failure is data: recorded, never raised
        _record_failure(traj, "time_budget" if isinstance(e, TimeBudgetError) else stage, e)
    finally:
        if env is not None:
            try:  # off the event loop: releasing a pooled sandbox schedules work on this loop
                await asyncio.to_thread(env.close)
            except Exception as e:  # noqa: BLE001
                traj.metadata["close_error"] = f"{type(e).__name__}: {e}"
        traj.timings.update(timings, episode_s=time.monotonic() - t0)
    return traj


def _add_env_timings(timings: dict[str, float], info: Any) -> None:
    """The env's own phases of a reset or step (`info["timings"]`: sandbox, sandbox_acquire, render,
    reset, parse, score...) summed into the episode's timings as `<phase>_s`; tools' and the whole
    step's own entries are left out (`env_s` times the step from the loop)."""
    for phase, seconds in ((info or {}).get("timings") or {}).items():
        if not phase.startswith("tool:") and phase != "step":
            timings[f"{phase}_s"] = timings.get(f"{phase}_s", 0.0) + float(seconds)


def _append_generated(traj: Trajectory, ids: list[int], out: Any, record_routing: bool) -> None:
    versions = getattr(out, "versions", None) or [getattr(out, "version", 0)] * len(ids)
    traj.completion_ids.extend(ids)
    traj.logprobs.extend(float(x) for x in out.logprobs)
    traj.loss_mask.extend([1] * len(ids))
    traj.versions.extend(int(v) for v in versions)
    if record_routing:
        routed = getattr(out, "routed_experts", None) or [[] for _ in ids]
        traj.routed_experts.extend([[list(map(int, layer)) for layer in tok] for tok in routed])


def _record_failure(traj: Trajectory, stage: str, error: Exception) -> None:
    traj.error = f"{type(error).__name__}: {error}"
    traj.reward, traj.terminated, traj.truncated = 0.0, False, False
    traj.metadata.pop("truncated_by", None)
    traj.metadata["failed_at"] = stage
    traj.metadata["traceback"] = "".join(traceback.format_exception(error, limit=-8))


# -- scripted policies ------------------------------------------------------------------------------
def scripted_generate(template: ChatTemplate, policy: Callable[[], Any], version: int = 0) -> Generate:
    """A `generate` that plays `policy()` instead of sampling: the next assistant message as
    text (special tokens by name), an assistant Message, or exact token ids. Log-probs are 0;
    like an engine, the message is cut at `sampling.max_tokens` (finish_reason "length")."""

    async def generate(token_ids, sampling, images=None, key=None, group_key=None) -> GenerationResult:
        action = policy()
        ids = [int(i) for i in action] if isinstance(action, (list, tuple)) else action_to_ids(template, action)
        ids = ids[:sampling.max_tokens]
        finish = "stop" if ids and ids[-1] == template.stop_token_id else "length"
        return GenerationResult(request_id=key or "", token_ids=ids, logprobs=[0.0] * len(ids),
                                versions=[version] * len(ids), finish_reason=finish, prompt_tokens=len(token_ids))

    return generate


async def oracle_episode(make_env: Callable[[], Any], spec: EpisodeSpec, template: ChatTemplate, *,
                         max_tokens: int = NO_LIMIT, max_turns: int = NO_LIMIT, max_context_tokens: int = NO_LIMIT,
                         time_budget_s: float = math.inf, context: Any = None) -> Trajectory:
    """One episode played by the env's scripted `oracle()` (fails at "generate" when it has none);
    asked for a summary (context compaction), it answers with the env's `oracle_summary()`."""
    made: list[Any] = []

    def make() -> Any:
        made.append(make_env())
        return made[-1]

    def summary() -> Any:
        env = made[-1].unwrapped
        if not hasattr(env, "oracle_summary"):
            raise NoOracleError(f"{type(env).__name__} defines no oracle_summary(); rollout.context.strategy "
                                "summarize asks the oracle for summaries")
        return env.oracle_summary()

    oracle = scripted_generate(template, lambda: made[-1].unwrapped.oracle())
    summarise = scripted_generate(template, summary)

    async def generate(token_ids, sampling, **kw) -> GenerationResult:
        request = getattr(context, "summary_request", SUMMARY_REQUEST)
        return await (summarise if asks_for_summary(template, token_ids, request) else oracle)(token_ids, sampling, **kw)

    return await run_episode(make, spec, generate, template, SamplingParams(max_tokens=max_tokens),
                             max_turns=max_turns, max_context_tokens=max_context_tokens, time_budget_s=time_budget_s,
                             context=context)


def run_oracle_episode(env: Any, seed: int | None = 0, *, options: dict[str, Any] | None = None,
                       template: ChatTemplate | None = None, **limits: Any) -> Trajectory:
    """The oracle episode of `env` (a registered id, or an env: wrapped or not, made with its own
    template) through the episode loop. The env's own `max_turns` applies; `limits` add the loop's."""
    if isinstance(env, str):
        env_id, template = env, template or ChatTemplate()

        def make() -> Any:
            return gymnasium.make(env_id, **({"template": template} if is_tool_env(env_id) else {}))
    else:
        made = env
        env_id = made.spec.id if made.spec is not None else type(made.unwrapped).__name__
        template = template or getattr(made.unwrapped, "template", None) or ChatTemplate()

        def make() -> Any:
            return made
    spec = EpisodeSpec(id=f"oracle-{seed}", env_id=env_id, seed=seed, options=dict(options or {}))
    return run_sync(oracle_episode(make, spec, template, **limits))


def run_sync(coro: Awaitable) -> Any:
    """Run a coroutine to the end from synchronous code (in a thread of its own under a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# -- a job's episodes -------------------------------------------------------------------------------
def make_template(cfg: JobConfig) -> ChatTemplate:
    """The chat template whose image-token count matches the model's vision tower."""
    vc = getattr(cfg.model.k3_config(), "vision_config", None)
    kw = {}
    if vc is not None:
        for name, key in (("patch_size", "patch_size"), ("in_patch_limit", "in_patch_limit"),
                          ("side_patch_limit", "patch_limit_on_one_side")):
            if getattr(vc, key, None) is not None:
                kw[name] = getattr(vc, key)
    return ChatTemplate(load_tokenizer(cfg.model.tokenizer), thinking=cfg.model.thinking,
                        image_tokens=functools.partial(num_image_tokens, **kw))


def job_sampling(cfg: JobConfig) -> SamplingParams:
    s = cfg.rollout.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens_per_turn)


def job_limits(cfg: JobConfig) -> dict[str, Any]:
    """The loop's limits in a job."""
    return {"max_turns": cfg.envs.max_turns, "max_context_tokens": cfg.rollout.max_context_tokens,
            "time_budget_s": cfg.envs.episode_time_budget_s, "context": cfg.rollout.context}


def sandbox_limits(cfg: JobConfig) -> dict[str, Any]:
    s = cfg.sandbox
    return {"memory_mb": s.memory_mb, "cpus": s.cpus, "pids": s.pids, "timeout_s": s.exec_timeout_s, "image": s.image}


def make_env(spec: EpisodeSpec, cfg: JobConfig, template: ChatTemplate | None = None,
             sandbox_factory: Callable[[], Any] | None = None,
             sandbox_release: Callable[[Any], None] | None = None) -> Any:
    """The episode's environment. A ToolEnv (registered with its class) also gets the job's chat
    template, turn limit, time budget and sandbox settings; its `env_kwargs` win. Any other
    Gymnasium env gets only its `env_kwargs`."""
    kwargs = dict(spec.env_kwargs)
    if is_tool_env(spec.env_id):
        kwargs.setdefault("max_turns", cfg.envs.max_turns)
        kwargs.setdefault("time_budget_s", cfg.envs.episode_time_budget_s)
        kwargs.setdefault("template", template or make_template(cfg))
        kwargs.setdefault("sandbox_backend", cfg.sandbox.backend)
        kwargs.setdefault("sandbox_limits", sandbox_limits(cfg))
        if sandbox_factory is not None:
            kwargs.setdefault("sandbox_factory", sandbox_factory)
            kwargs.setdefault("sandbox_release", sandbox_release)
    elif kwargs.get("sandboxed") and getattr(registered_entry_point(spec.env_id), "is_agent_env", False):
        kwargs.setdefault("time_budget_s", cfg.envs.episode_time_budget_s)  # a sandboxed agent: the pool's sandboxes
        kwargs.setdefault("sandbox_backend", cfg.sandbox.backend)
        kwargs.setdefault("sandbox_limits", sandbox_limits(cfg))
        if sandbox_factory is not None:
            kwargs.setdefault("sandbox_factory", sandbox_factory)
            kwargs.setdefault("sandbox_release", sandbox_release)
    return gymnasium.make(spec.env_id, disable_env_checker=True, **kwargs)
