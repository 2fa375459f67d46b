"""On-policy distillation: teachers score the tokens the student sampled.

The student samples its episodes as in RL; a teacher (an HF-layout checkpoint of the K3
architecture, any preset, built with `build_model(..., checkpoint=)`) computes log T(y_t) of every
token the student sampled, in the student's own context. The per-token reverse KL of the student
to the teacher,

    KL(pi || T) = E_{y ~ pi} [ log pi(y_t | y_<t) - log T(y_t | y_<t) ],

falls under a policy gradient whose per-token reward is r_t = log T(y_t) - log mu(y_t), with mu the
behaviour policy that sampled y_t (its log-prob is recorded with every token), by default
undiscounted: each token is credited with its own term only. So distillation is one more advantage, added to
the env's (per episode or per turn, learner/advantages.py) in the same loss:

    A_t = A_env_t + coef * clip(log T(y_t) - log mu(y_t), -R, R)          on sampled tokens

(the K3 report's per-token reward, arXiv 2607.24653 §4, clips the log-ratio to [-R, R]: a token
the teacher gives almost no mass would otherwise outweigh every other; `clip=None` leaves it).

Credit over later tokens (`discount` gamma): with r_t = clip(log T(y_t) - log mu(y_t)),

    A_t = A_env_t + coef * sum_{s >= t} gamma^(s - t) r_s           (s, t counted over sampled tokens)

gamma = 0 (the default) is the per-token rule above; gamma = 1 is the score-function gradient of
the whole sequence's reverse KL, grad E[sum_s log pi/T] = E[sum_t grad log pi(y_t) sum_{s>=t} (log pi/T)(y_s)]:
a token is also charged for what the teacher thinks of the tokens that follow it. It matters in
multi-turn episodes, where a teacher disagrees most in the turns after a student's mistake (a
wrong lookup, then an answer the teacher would not give): per token, that disagreement lands on
the later turn, not on the token that caused it (experiments/distill_turns.py measures where it lands).
Tool output (loss_mask 0) carries no r and does not count as a step of the discount.

The exact estimator (`estimator: "exact"`): the same per-token reverse KL, taken over the whole
vocabulary rather than through the one sampled token, as a loss term beside the policy gradient:

    loss += coef * sum_t a_t KL(pi(.|ctx_t) || T(.|ctx_t)),   KL = sum_v pi(v) (log pi(v) - log T(v))

(a_t the policy loss's aggregation weight of sampled position t; contexts are the student's own
samples, held fixed). Since E_{y ~ pi}[(log T(y) - log pi(y)) grad log pi(y)] = -grad KL(pi || T) at
each position, its gradient is what the sampled rule's (discount 0) estimates, without one sample's
noise: the teacher's signal on KeyLookup sits in a few positions of ~200 (the key, the value), which one
sampled log-ratio each hardly separates from the rest. The teacher's last hidden states go to the
student's forward (`distill_from`), which forms the KL chunk by chunk (`chunked_reverse_kl`); so an
exact teacher lives in the learner (`engines: 0`), and its episodes' env advantage is only scaled by
env_coef here (`distill_advantages`; `exact_kl_weights` gives the loss its per-position weights).

Several teachers: the episodes of an env go to the teacher named for it (the K3 report's
multi-teacher setup, one expert per domain); a teacher named for no env takes the others, and
episodes no teacher takes keep the env's advantage alone.

Where a teacher runs: with `engines: 0` the learner loads it (`load_teachers`) and scores in its own
process; otherwise the job serves it by engines of its own (learner/teacher_engines.py), which score the
step's episodes before the learner gets them and attach log T to each, `metadata["teacher_logprobs"]`;
`distill_advantages` uses attached scores where an episode has them and scores the rest itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3rl.model.factory import build_model
from k3rl.types import Trajectory

from .advantages import turn_returns
from .data import build_micro_batches

__all__ = ["TEACHER_LOGPROBS", "Teacher", "distill_advantages", "exact_kl_weights", "exact_teachers", "load_teacher",
           "load_teachers", "per_completion", "returns_to_go", "score", "teacher_hidden", "teacher_index"]

TEACHER_LOGPROBS = "teacher_logprobs"  # metadata key: log T per completion token, attached by a teacher's engines


@dataclass
class Teacher:
    model: torch.nn.Module | None  # None: served by engines of its own, whose scores the episodes carry
    envs: tuple[str, ...] = ()  # the env ids it teaches; () = every env no other teacher names
    coef: float = 1.0
    clip: float | None = None  # R: the log-ratio clipped to [-R, R]; None = not clipped
    name: str = ""  # its checkpoint, for errors
    discount: float = 0.0  # gamma: a token's advantage also sums gamma^k of the k-th sampled token after it
    estimator: str = "sampled"  # "exact": the per-token reverse KL over the vocabulary, a loss term (module doc)


def load_teacher(checkpoint: str, preset: str, overrides: dict | None = None, *, envs: Sequence[str] = (),
                 coef: float = 1.0, clip: float | None = None, discount: float = 0.0, estimator: str = "sampled",
                 device: str = "cpu", dtype: str = "float32") -> Teacher:
    """A teacher from an HF-layout checkpoint (its config.json must match `preset` + `overrides`)."""
    model = build_model(preset, overrides, dtype=dtype, device=device, checkpoint=checkpoint).eval()
    return Teacher(model, tuple(envs), coef, clip, name=checkpoint, discount=discount, estimator=estimator)


def load_teachers(specs: Sequence, device: str = "cpu") -> list[Teacher]:
    """The learner's teachers from `learner.distill.teachers`: one with `engines: 0` is loaded here (on
    `device`); the others are served by engines of their own and come without a model."""
    return [load_teacher(s.checkpoint, s.preset, s.overrides, envs=s.envs, coef=s.coef, clip=s.clip,
                         discount=s.discount, estimator=s.estimator, device=device)
            if s.engines == 0 else Teacher(None, tuple(s.envs), s.coef, s.clip, name=s.checkpoint, discount=s.discount)
            for s in specs]


def per_completion(flat: torch.Tensor, mb, trajectories: list[Trajectory]) -> dict[int, torch.Tensor]:
    """Cut a micro-batch's per-position values (`flat`, [positions]) back into each trajectory's
    completion, [len(completion_ids)] (0 where loss_mask is 0), by trajectory index. A segmented
    trajectory's segment starts are not positions of the micro-batch (nothing predicts them)."""
    flat = flat.detach().float().cpu()
    out, offset = {}, 0
    for s in mb.traj_indices:
        t = trajectories[s]
        L = len(t.token_ids) - 1
        keep = torch.ones(L, dtype=torch.bool)  # the positions build_micro_batches kept
        keep[[b - 1 for b in t.segment_starts]] = False
        n = int(keep.sum())
        full = torch.zeros(L)
        full[keep] = flat[offset:offset + n]
        offset += n
        out[s] = full[len(t.prompt_ids) - 1:] * torch.tensor(t.loss_mask, dtype=torch.float32)
    return out


@torch.no_grad()
def score(model: torch.nn.Module, trajectories: list[Trajectory], micro_batch_tokens: int = 4096,
          temperature: float = 1.0) -> list[torch.Tensor]:
    """log model(y_t) under softmax(logits / temperature) of every sampled completion token,
    [len(completion_ids)] per trajectory (0 where loss_mask is 0); each context segment is scored as
    the sequence it was. The temperature is the student's policy temperature: log T - log mu then
    compares the two policies at the same temperature (a teacher at 1 against a student at 0.7 would
    read every confident student token as a disagreement)."""
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [torch.zeros(0)] * len(trajectories)
    for mb in build_micro_batches(trajectories, micro_batch_tokens, "token_mean"):
        logp, _ = model(mb.input_ids.to(device), images=mb.media(model), cu_seqlens=mb.cu_seqlens.to(device),
                        targets=mb.targets[None].to(device), temperature=temperature)
        for s, values in per_completion(logp[0], mb, trajectories).items():
            out[s] = values
    return out


def teacher_index(env_id: str, teachers: Sequence) -> int | None:
    """Which teacher (anything with `.envs`) scores an episode of `env_id`: the one naming it, else the
    one naming no env, else none."""
    named = next((i for i, t in enumerate(teachers) if env_id in t.envs), None)
    return named if named is not None else next((i for i, t in enumerate(teachers) if not t.envs), None)


def _teacher_logprobs(teacher: Teacher, trajectories: list[Trajectory], micro_batch_tokens: int,
                      temperature: float) -> list[torch.Tensor]:
    """log T of each trajectory's completion: the scores its teacher's engines attached, else scored here."""
    out = [None if t.metadata.get(TEACHER_LOGPROBS) is None
           else torch.tensor(t.metadata[TEACHER_LOGPROBS], dtype=torch.float32) for t in trajectories]
    for t, log_t in zip(trajectories, out, strict=True):
        if log_t is not None and len(log_t) != len(t.completion_ids):
            raise ValueError(f"episode {t.id}: metadata[{TEACHER_LOGPROBS!r}] has {len(log_t)} entries but "
                             f"completion_ids has {len(t.completion_ids)}; they must align token by token")
    missing = [i for i, log_t in enumerate(out) if log_t is None]
    if missing and teacher.model is None:
        raise ValueError(
            f"teacher {teacher.name} is served by engines of its own, but episode {trajectories[missing[0]].id} "
            f"carries no scores of it (metadata[{TEACHER_LOGPROBS!r}]): score the batch with "
            "k3rl.learner.teacher_engines.TeacherGroup before train_step (the job does), or set the teacher's "
            "engines: 0 to score it in the learner")
    if missing:
        for i, log_t in zip(missing, score(teacher.model, [trajectories[i] for i in missing], micro_batch_tokens,
                                           temperature), strict=True):
            out[i] = log_t
    return out


def returns_to_go(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over the positions where mask is 1 (steps counted over
    those only; G is 0 elsewhere). gamma = 0: G = r * mask."""
    r = r * mask
    if gamma == 0:
        return r
    sampled = mask.nonzero()[:, 0]
    out = torch.zeros_like(r)
    out[sampled] = torch.tensor(turn_returns(r[sampled].tolist(), gamma), dtype=r.dtype)
    return out


def distill_advantages(trajectories: list[Trajectory], env_advantages: torch.Tensor, teachers: Sequence[Teacher],
                       micro_batch_tokens: int = 4096, temperature: float = 1.0, env_coef: float = 1.0) -> torch.Tensor:
    """[N, C] per-token advantages: the env's (`env_advantages` [N] per episode or [N, >= C] per
    token), times `env_coef` on the episodes a teacher scores, plus, on sampled tokens, coef * clip(log T -
    log mu) of the episode's teacher (its log T attached by the teacher's engines, or scored here at the
    policy `temperature`), summed over the tokens that follow with the teacher's `discount` (`returns_to_go`).
    env_coef 0 is pure on-policy distillation: A_t = coef * sum_s gamma^(s-t) clip(log T - log mu)_s. An
    exact teacher adds nothing here (its KL is a loss term: `exact_kl_weights`); its episodes' env
    advantage is still scaled by env_coef."""
    n, C = len(trajectories), max(len(t.completion_ids) for t in trajectories)
    env = torch.as_tensor(env_advantages, dtype=torch.float32)
    out = env[:, None].expand(n, C).clone() if env.dim() == 1 else env[:, :C].clone()
    for k, teacher in enumerate(teachers):
        mine = [i for i, t in enumerate(trajectories) if teacher_index(t.env_id, teachers) == k]
        if not mine:
            continue
        if teacher.estimator == "exact":  # its term is a loss of its own (`exact_kl_weights`), not an advantage
            out[mine] *= env_coef
            continue
        scored = _teacher_logprobs(teacher, [trajectories[i] for i in mine], micro_batch_tokens, temperature)
        for i, log_t in zip(mine, scored, strict=True):
            t = trajectories[i]
            mask = torch.tensor(t.loss_mask, dtype=torch.float32)
            log_mu = torch.tensor(t.logprobs, dtype=torch.float64).float()
            ratio = log_t - log_mu
            if teacher.clip is not None:
                ratio = ratio.clamp(-teacher.clip, teacher.clip)
            out[i] *= env_coef
            out[i, :len(t.completion_ids)] += teacher.coef * returns_to_go(ratio, mask, teacher.discount)
    return out


def exact_teachers(teachers: Sequence[Teacher]) -> list[int]:
    """Indices of the teachers whose reverse KL is taken exactly over the vocabulary."""
    return [k for k, t in enumerate(teachers) if t.estimator == "exact"]


@torch.no_grad()
def teacher_hidden(teacher: Teacher, mb) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's last hidden states over the micro-batch's tokens [1, T, d'], its lm_head weight): what
    the student's forward takes as `distill_from` to form KL(pi || T) position by position."""
    hidden = teacher.model(mb.input_ids, images=mb.media(teacher.model), cu_seqlens=mb.cu_seqlens, return_hidden=True)
    return hidden, teacher.model.lm_head.weight


def exact_kl_weights(trajectories: Sequence[Trajectory], teachers: Sequence[Teacher], seq_index: torch.Tensor,
                     mask: torch.Tensor, agg_weights: torch.Tensor) -> list[torch.Tensor]:
    """Per exact teacher, the weight of each position's KL(pi || T) in the micro-batch's loss [T]:
    coef x the position's aggregation weight a_t (the policy loss's, so the KL is averaged as the
    policy gradient is) where the position is a sampled token of an episode that teacher takes, else 0.
    `seq_index` indexes `trajectories` (the micro-batch's minibatch)."""
    owner = torch.tensor([-1 if (k := teacher_index(t.env_id, teachers)) is None else k for t in trajectories],
                         device=seq_index.device)[seq_index]
    a = agg_weights.float() * mask.float()
    return [a * teachers[k].coef * (owner == k) for k in exact_teachers(teachers)]
