"""Where a teacher's per-token signal lands: log T - log mu of a run's stored episodes, by turn.

    python experiments/distill_turns.py RUN TEACHER [--steps 1 2] [--temperature 0.7]

Scores the training episodes a job stored for the given steps (sampled by the student, with their
behaviour log-probs mu) with the teacher at TEACHER (an HF-layout checkpoint), as on-policy
distillation does (`learner/distill.py: score`), and sums the log-ratio by assistant turn and, for
the answer turn of two-turn KeyLookup episodes, by outcome (right value, right key only, the other key or one the task does not have).
The tokens the teacher disagrees with most (log-ratio below -1) are counted by text.
"""

from __future__ import annotations

import argparse
import collections

import torch

from k3rl.learner.distill import score
from k3rl.model import build_model
from k3rl.store import TrajectoryStore
from k3rl.tokenizer import load_tokenizer


def turn_of_tokens(loss_mask: list[int]) -> list[int]:
    """1, 2, ... for the tokens of the 1st, 2nd ... assistant turn (runs of loss_mask 1); 0 elsewhere."""
    out, turn, prev = [], 0, 0
    for x in loss_mask:
        turn += bool(x and not prev)
        out.append(turn if x else 0)
        prev = x
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("teacher")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    store = TrajectoryStore(args.run)
    episodes = [t for s in args.steps for t in store.read(step=s) if not t.error]
    teacher = build_model("k3-tiny", checkpoint=args.teacher).eval()
    log_t = score(teacher, episodes, temperature=args.temperature)
    tok = load_tokenizer()
    by_turn, by_outcome, worst = collections.defaultdict(list), collections.defaultdict(list), collections.Counter()
    for t, lt in zip(episodes, log_t, strict=True):
        ratio = (lt - torch.tensor(t.logprobs)).tolist()
        turns = turn_of_tokens(t.loss_mask)
        n = max(turns)
        outcome = "right value" if t.reward >= 1 else ("right key only" if t.reward > 0.3 else "other or no such key")
        for tk, r, k in zip(t.completion_ids, ratio, turns, strict=True):
            if not k:
                continue
            by_turn[(n, k)].append(r)
            if n == 2 and k == 2:
                by_outcome[outcome].append(r)
                if r < -1:
                    worst[(outcome, tok.decode([tk]))] += 1
    print(f"{len(episodes)} episodes of steps {args.steps}; log T - log mu per token (teacher at {args.temperature})")
    for (n, k), v in sorted(by_turn.items()):
        v = torch.tensor(v)
        print(f"  {n}-turn episodes, turn {k}: {len(v):6d} tokens, mean {v.mean():+.3f}, "
              f"sum per episode {v.sum() / len(episodes):+.3f}, min {v.min():+.2f}")
    for name, v in by_outcome.items():
        v = torch.tensor(v)
        print(f"  answer turn after {name}: {len(v):5d} tokens, mean {v.mean():+.3f}, sum {v.sum():+.1f}")
    print("  tokens below -1 in answer turns:", worst.most_common(8))


if __name__ == "__main__":
    main()
