"""Shared records that travel between the parts of k3rl.

Everything here is a validated pydantic model that serialises to JSON and to Arrow and
back without loss:
  * token ids stay ints, log-probs stay the exact float64 value they had (JSON writes
    the shortest repr that round-trips, Arrow stores float64),
  * images are PNG bytes (base64 in JSON, binary in Arrow),
  * tensors of a WeightUpdate travel as safetensors bytes.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(data: bytes) -> bytes:
    if not data.startswith(PNG_MAGIC):
        raise ValueError("image must be PNG bytes (they start with \\x89PNG); encode with k3rl.images.to_png()")
    return data


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes):
        return cls.model_validate_json(text)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: Any) -> Any:
    if isinstance(value, str):
        return base64.b64decode(value.encode("ascii"), validate=True)
    return value


class SamplingParams(_Record):
    """How the inference engine samples one completion."""

    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_tokens: int = Field(256, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_strings: list[str] = Field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True
    return_routed_experts: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ToolCall(_Record):
    """One call the model made: `[open]call tool="NAME" index="i"[sep] ...arguments... [close]call[sep]`."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int = Field(1, ge=1, description="1-based position among the parallel calls of one message")
    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    raw_arguments: str | None = Field(None, description="arguments the model wrote that are not JSON, as written")


class Turn(_Record):
    """One message of an episode, with where its tokens sit in the trajectory's token stream.

    `start`/`end` index into `Trajectory.token_ids` (prompt and completion concatenated).
    """

    role: Literal["system", "user", "assistant", "tool"]
    text: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_name: str | None = None
    tool_index: int | None = None
    images: list[bytes] = Field(default_factory=list)
    start: int = Field(0, ge=0)
    end: int = Field(0, ge=0)
    error: str | None = None
    duration_s: float = 0.0
    reward: float = 0.0
    segment: int = Field(0, ge=0, description="the context segment the turn's tokens are in (see Trajectory.segment_starts)")
    compaction: Literal["carried", "dropped", "summary_request", "summary"] | None = Field(
        None, description="how context compaction (rollout.context) made this turn, None for a turn of the "
                          "conversation itself: carried = an earlier message repeated at the start of a new "
                          "segment, dropped = carried with its tool output or images replaced by a placeholder, "
                          "summary_request = the loop asking the policy to summarise, summary = its answer")

    @field_validator("images", mode="before")
    @classmethod
    def _decode_images(cls, value):
        return [_check_png(_unb64(v)) for v in (value or [])]

    @field_serializer("images", when_used="json")
    def _encode_images(self, images: list[bytes]):
        return [_b64(b) for b in images]

    @model_validator(mode="after")
    def _span(self):
        if self.end < self.start:
            raise ValueError(f"turn span end ({self.end}) is before start ({self.start})")
        return self


class Trajectory(_Record):
    """A token-exact record of one episode.

    `prompt_ids` are the opening context; `completion_ids` everything after it (sampled
    assistant tokens and the tool-result tokens appended between them). The per-token
    arrays `logprobs`, `loss_mask` and `versions` have the length of `completion_ids`:
    tokens the model did not sample have loss_mask 0, logprob 0.0 and version -1.

    Segments (context compaction, `rollout.context`): an episode whose context was compacted is
    a sequence of contexts, each a token-exact sequence of its own, laid end to end in
    `token_ids`. `segment_starts` holds where each segment after the first begins (empty: one
    segment). Segment k is `token_ids[starts[k]:starts[k+1]]` (starts = [0, *segment_starts]):
    exactly what the engine was given and sampled in it. Its first tokens (the context the
    compaction rebuilt) are not sampled; `segments()` cuts the episode into them.
    """

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    env_id: str
    seed: int | None = None
    task_id: str = ""
    group_id: str = ""
    prompt_ids: list[int]
    completion_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    routed_experts: list[list[list[int]]] | None = Field(
        None, description="per completion token, per MoE layer, the expert ids it was routed to"
    )
    turns: list[Turn] = Field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    error: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    segment_starts: list[int] = Field(default_factory=list,
                                      description="where each context segment after the first begins in token_ids")

    @model_validator(mode="after")
    def _lengths(self):
        n = len(self.completion_ids)
        for name in ("logprobs", "loss_mask", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"{name} has {got} entries but completion_ids has {n}; they must align token by token")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(
                f"routed_experts has {len(self.routed_experts)} entries but completion_ids has {n}"
            )
        total = len(self.prompt_ids) + n
        for i, t in enumerate(self.turns):
            if t.end > total:
                raise ValueError(f"turns[{i}] ends at token {t.end} but the trajectory has only {total} tokens")
        bounds = [len(self.prompt_ids), *self.segment_starts]
        if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)) or (self.segment_starts and bounds[-1] >= total):
            raise ValueError(f"segment_starts {self.segment_starts} must increase, each after the first prompt "
                             f"({len(self.prompt_ids)} tokens) and before the end ({total} tokens)")
        return self

    # -- convenience ---------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        """Assistant messages sampled (summaries included; a message carried into a new segment is not counted again)."""
        return sum(1 for t in self.turns if t.role == "assistant" and t.compaction != "carried")

    @property
    def images(self) -> list[bytes]:
        return [img for t in self.turns for img in t.images]

    @property
    def segment_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each context segment in `token_ids` (one segment when nothing was compacted)."""
        starts = [0, *self.segment_starts]
        return list(zip(starts, [*starts[1:], len(self.prompt_ids) + len(self.completion_ids)], strict=True))

    def segments(self) -> list[Trajectory]:
        """The episode cut into its context segments, each a Trajectory of its own (the whole
        episode when it has one): prompt = the segment's tokens up to its first sampled token,
        its turns and per-token arrays; `metadata["episode_id"]` and `["segment"]` name it.
        Every segment is a sequence the engine saw as is; the learner trains each one."""
        if not self.segment_starts:
            return [self]
        out = []
        P = len(self.prompt_ids)
        for k, (lo, hi) in enumerate(self.segment_bounds):
            # the segment's prompt: up to its first sampled token (segment 0: the episode's prompt)
            cut = P if k == 0 else next((j for j in range(lo, hi) if self.loss_mask[j - P]), hi - 1)
            c = slice(cut - P, hi - P)
            out.append(self.model_copy(update={
                "id": f"{self.id}#{k}", "prompt_ids": self.token_ids[lo:cut], "completion_ids": self.completion_ids[c],
                "logprobs": self.logprobs[c], "loss_mask": self.loss_mask[c], "versions": self.versions[c],
                "routed_experts": None if self.routed_experts is None else self.routed_experts[c],
                "turns": [t.model_copy(update={"start": t.start - lo, "end": t.end - lo})
                          for t in self.turns if t.segment == k],
                "segment_starts": [], "metadata": {**self.metadata, "episode_id": self.id, "segment": k}}))
        return out

    def append(self, ids: list[int], *, generated: bool, logprobs: list[float] | None = None,
               version: int = -1, routed: list[list[list[int]]] | None = None) -> tuple[int, int]:
        """Append tokens to the completion; returns their (start, end) span in `token_ids`."""
        start = len(self.prompt_ids) + len(self.completion_ids)
        if generated and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError("generated tokens need one behaviour log-prob each")
        self.completion_ids.extend(ids)
        self.logprobs.extend(logprobs if generated else [0.0] * len(ids))
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        self.versions.extend([version if generated else -1] * len(ids))
        if self.routed_experts is not None:
            self.routed_experts.extend(routed if (generated and routed) else [[] for _ in ids])
        return start, start + len(ids)

    # -- Arrow -----------------------------------------------------------------------
    @staticmethod
    def arrow_schema() -> pa.Schema:
        return _TRAJECTORY_SCHEMA

    def to_arrow_row(self) -> dict[str, Any]:
        d = self.model_dump(mode="python")
        d["turns"] = [
            {**t, "tool_calls": [{**c, "arguments": json.dumps(c["arguments"], sort_keys=True)} for c in t["tool_calls"]]}
            for t in d["turns"]
        ]
        d["metadata"] = json.dumps(d["metadata"], sort_keys=True)
        d["timings"] = list(d["timings"].items())
        return d

    @classmethod
    def from_arrow_row(cls, row: dict[str, Any]) -> Trajectory:
        row = dict(row)
        row["turns"] = [
            {**t, "tool_calls": [{**c, "arguments": json.loads(c["arguments"])} for c in t["tool_calls"]]}
            for t in row["turns"]
        ]
        row["metadata"] = json.loads(row["metadata"])
        row["timings"] = dict(row["timings"])
        return cls.model_validate(row)

    @staticmethod
    def to_arrow(trajectories: list[Trajectory]) -> pa.Table:
        return pa.Table.from_pylist([t.to_arrow_row() for t in trajectories], schema=_TRAJECTORY_SCHEMA)

    @staticmethod
    def from_arrow(table: pa.Table) -> list[Trajectory]:
        return [Trajectory.from_arrow_row(r) for r in table.to_pylist()]


_TOOL_CALL_TYPE = pa.struct(
    [("name", pa.string()), ("arguments", pa.string()), ("index", pa.int64()), ("id", pa.string()),
     ("raw_arguments", pa.string())]
)
_TURN_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("text", pa.string()),
        ("thinking", pa.string()),
        ("tool_calls", pa.list_(_TOOL_CALL_TYPE)),
        ("tool_name", pa.string()),
        ("tool_index", pa.int64()),
        ("images", pa.list_(pa.binary())),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("error", pa.string()),
        ("duration_s", pa.float64()),
        ("reward", pa.float64()),
        ("segment", pa.int64()),
        ("compaction", pa.string()),
    ]
)
_TRAJECTORY_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("env_id", pa.string()),
        ("seed", pa.int64()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("versions", pa.list_(pa.int32())),
        ("routed_experts", pa.list_(pa.list_(pa.list_(pa.int16())))),
        ("turns", pa.list_(_TURN_TYPE)),
        ("reward", pa.float64()),
        ("terminated", pa.bool_()),
        ("truncated", pa.bool_()),
        ("error", pa.string()),
        ("timings", pa.map_(pa.string(), pa.float64())),
        ("metadata", pa.string()),
        ("segment_starts", pa.list_(pa.int64())),
    ]
)


class WeightBucket(_Record):
    """A group of tensors sent together, named as in the official checkpoint."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    tensors: dict[str, Any] = Field(description="official HF name -> torch.Tensor")

    @field_validator("tensors", mode="before")
    @classmethod
    def _load(cls, value):
        if isinstance(value, (bytes, str)):
            # lazy: `import k3rl` (the CLI) stays free of torch (seconds)
            from safetensors.torch import load

            return dict(load(_unb64(value)))
        # lazy: `import k3rl` (the CLI) stays free of torch (seconds)
        import torch

        for name, t in value.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensor {name!r} is a {type(t).__name__}, expected torch.Tensor")
        return value

    @field_serializer("tensors", when_used="json")
    def _dump(self, tensors):
        return _b64(self.to_bytes())

    def to_bytes(self) -> bytes:
        # lazy: `import k3rl` (the CLI) stays free of torch (seconds)
        from safetensors.torch import save

        return save({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class WeightUpdate(_Record):
    """A versioned set of new weights for the inference engines.

    Engines switch atomically: every token is produced by exactly one version.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    version: int = Field(ge=0)
    buckets: list[WeightBucket] = Field(default_factory=list)
    transport: Literal["object_store", "nccl", "cuda_ipc", "inline"] = "object_store"
    full: bool = Field(True, description="True when the buckets hold every weight of the model")

    @property
    def names(self) -> list[str]:
        return [n for b in self.buckets for n in b.tensors]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for b in self.buckets:
            for name, t in b.tensors.items():
                if name in out:
                    raise ValueError(f"tensor {name!r} appears in two buckets of weight update v{self.version}")
                out[name] = t
        return out

    @classmethod
    def from_state_dict(cls, version: int, state: dict[str, Any], bucket_bytes: int = 256 << 20, **kw) -> WeightUpdate:
        buckets: list[WeightBucket] = []
        cur: dict[str, Any] = {}
        size = 0
        for name, t in state.items():
            nb = t.numel() * t.element_size()
            if cur and size + nb > bucket_bytes:
                buckets.append(WeightBucket(tensors=cur))
                cur, size = {}, 0
            cur[name] = t
            size += nb
        if cur:
            buckets.append(WeightBucket(tensors=cur))
        return cls(version=version, buckets=buckets, **kw)
