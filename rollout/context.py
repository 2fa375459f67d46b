"""Context compaction: what the episode loop does when an episode's context nears its limit.

`rollout.context` (k3rl.config.ContextSection) picks a strategy; `compact_at` (a share of
`rollout.max_context_tokens`) says when. After an env step, when the context has reached
`compact_at * max_context_tokens`, the loop starts a new *segment*: a fresh chat session that
opens with the tool declaration and the episode's opening messages (the system prompt and the
task, images included, always whole), then:

  * drop_tool_outputs: every later message again, except that the output of a tool older than
    the last `keep_last_turns` turns becomes the placeholder DROPPED_OUTPUT;
  * summarize: first the loop asks the policy for a summary (SUMMARY_REQUEST, a user message
    of the old segment; the policy's answer is a sampled, trained assistant turn of it), then
    the new segment holds the summary (SUMMARY_INTRO + its text, a user message) and the last
    `keep_last_turns` turns.

A turn is one assistant message and the env's replies to it. Assistant messages are carried as
the ids that were sampled (so a carried message is the same tokens, now as context).

Images: those of the opening are always kept; an image in a later message is kept while that
message is among the last `keep_last_turns` turns and replaced by the text DROPPED_IMAGE
after (drop_tool_outputs drops a whole old tool output, images included; summarize keeps only
the last turns anyway).

A compaction only happens when it helps: when the new segment's context (the summary not
counted) stays under the threshold. Otherwise the episode goes on and ends truncated by
"context" when the context is full, as with strategy none.

Each segment is token-exact: its tokens are the session it was rendered in, exactly what the
engine was given and sampled in it (`Trajectory.segment_starts`, `Trajectory.segments()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3rl.chat import ChatSession, ChatTemplate, Message
from k3rl.config import ContextSection
from k3rl.messages import IMAGE_PLACEHOLDER
from k3rl.types import Turn

# the defaults of rollout.context.summary_request / summary_intro
SUMMARY_REQUEST = ContextSection.model_fields["summary_request"].default
SUMMARY_INTRO = ContextSection.model_fields["summary_intro"].default
DROPPED_OUTPUT = "[tool output removed to save context]"
DROPPED_IMAGE = "[image removed to save context]"


@dataclass
class _Exchange:
    """One turn: the assistant's sampled ids and its Turn record, then the env's replies."""

    ids: list[int]
    said: Turn
    replies: list[Message] = field(default_factory=list)


@dataclass
class Segment:
    """A new segment's context: the session (generation prompt not added yet) and its turns
    (spans relative to the segment's first token)."""

    session: ChatSession
    turns: list[Turn]
    images: list[bytes]


class Compactor:
    """One episode's compaction state: it records the conversation as the loop runs it and
    builds the next segment's context when the loop asks."""

    def __init__(self, policy: Any, template: ChatTemplate, max_context_tokens: int,
                 tools: list[dict[str, Any]] | None) -> None:
        if policy.strategy not in ("drop_tool_outputs", "summarize"):
            raise ValueError(f"rollout.context.strategy {policy.strategy!r} does not compact; use "
                             "drop_tool_outputs or summarize")
        self.strategy, self.keep = policy.strategy, policy.keep_last_turns
        self.request_text = getattr(policy, "summary_request", SUMMARY_REQUEST)
        self.intro_text = getattr(policy, "summary_intro", SUMMARY_INTRO)
        self.threshold = int(policy.compact_at * max_context_tokens)
        self.max_context_tokens = max_context_tokens
        self.template, self.tools = template, tools
        asking = template.session()  # what the summary request adds to a context
        self.request_tokens = len(asking.add(Message(role="user", content=self.request_text)))
        self.request_tokens += len(asking.add_generation_prompt())
        self.opening: list[Message] = []
        self.summary: str | None = None  # the last summary (summarize)
        self.exchanges: list[_Exchange] = []

    # -- recording ---------------------------------------------------------------------------
    def open(self, messages: list[Message]) -> None:
        self.opening = list(messages)

    def said(self, ids: list[int], turn: Turn) -> None:
        self.exchanges.append(_Exchange(list(ids), turn))

    def replied(self, message: Message) -> None:
        self.exchanges[-1].replies.append(message)

    # -- deciding ------------------------------------------------------------------------------
    def due(self, context_tokens: int) -> bool:
        """Whether to compact now: the context has reached the threshold, a new segment would be under
        it and (summarize) there is room to ask for the summary."""
        if context_tokens < self.threshold:
            return False
        if self.strategy == "summarize" and context_tokens + self.request_tokens >= self.max_context_tokens:
            return False  # no room left to ask: the episode goes on as without compaction
        summary = "" if self.strategy == "summarize" else None
        return len(self.next_segment(summary).session.rendered) < self.threshold

    # -- building --------------------------------------------------------------------------------
    def next_segment(self, summary: str | None = None) -> Segment:
        """The next segment's context; `summary` (strategy summarize) is the policy's summary text."""
        session = self.template.session(tools=self.tools or None)
        turns: list[Turn] = []
        images: list[bytes] = []

        def add(m: Message, kind: str | None) -> None:
            start = len(session.rendered)
            session.add(m)
            images.extend(m.images)
            turns.append(Turn(role=m.role, text=m.content, images=m.images, tool_name=m.tool_name,
                              tool_index=m.tool_index, start=start, end=len(session.rendered), compaction=kind))

        for m in self.opening:
            add(m, "carried")
        if self.strategy == "summarize":
            add(Message(role="user", content=self.intro_text + (summary or "")), "carried")
            exchanges = self.exchanges[len(self.exchanges) - self.keep:] if self.keep else []
        else:
            exchanges = self.exchanges
        recent = len(exchanges) - self.keep
        for i, ex in enumerate(exchanges):
            start = len(session.rendered)
            session.add_generation_prompt()
            session.add_generated(ex.ids)
            turns.append(ex.said.model_copy(update={"start": start, "end": len(session.rendered), "compaction": "carried",
                                                    "reward": 0.0, "duration_s": 0.0}))
            for m in ex.replies:
                kept, kind = (m, "carried") if i >= recent else _drop(m, tool_output=self.strategy != "summarize")
                add(kept, kind)
        return Segment(session, turns, images)

    def compact(self, summary: str | None = None) -> Segment:
        """The next segment (as `next_segment`); from now on the episode's history is what it holds."""
        segment = self.next_segment(summary)
        if self.strategy == "summarize":
            self.summary = summary
            self.exchanges = self.exchanges[len(self.exchanges) - self.keep:] if self.keep else []
        return segment


def _drop(m: Message, tool_output: bool) -> tuple[Message, str]:
    """An old message as carried into a new segment: a tool output replaced (`tool_output`), images replaced."""
    if tool_output and m.role == "tool":
        return m.model_copy(update={"content": DROPPED_OUTPUT, "images": []}), "dropped"
    if not m.images:
        return m, "carried"
    if IMAGE_PLACEHOLDER in m.content:
        text = m.content.replace(IMAGE_PLACEHOLDER, DROPPED_IMAGE)
    else:  # images render before the text
        text = " ".join([DROPPED_IMAGE] * len(m.images)) + (" " + m.content if m.content else "")
    return Message.model_validate({**m.model_dump(exclude={"images", "content"}), "content": text}), "dropped"


def asks_for_summary(template: ChatTemplate, token_ids: list[int], request: str = SUMMARY_REQUEST) -> bool:
    """Whether a context ends with the loop's summary request `request` (for scripted policies, which see
    only tokens)."""
    return request in template.tok.decode(list(token_ids[-(len(request) + 64):]))


def start_segment(traj: Any, compactor: Compactor, summary: str | None) -> tuple[ChatSession, list[bytes], int]:
    """Compact: append the next segment's context to `traj` (as unsampled tokens) and its turns;
    returns its session, its images and where it begins in `traj.token_ids`."""
    segment = compactor.compact(summary)
    start = len(traj.token_ids)
    traj.segment_starts.append(start)
    traj.append(list(segment.session.rendered.ids), generated=False)
    k = len(traj.segment_starts)
    traj.turns.extend(t.model_copy(update={"start": t.start + start, "end": t.end + start, "segment": k})
                      for t in segment.turns)
    return segment.session, segment.images, start
