"""On-policy distillation (learner/distill.py) with real k3-tiny teachers: the teacher's scores are
the learner's own log-probs of the sampled tokens, segment by segment; the advantage is
coef * (log T - log mu) on sampled tokens, added to the env's; each env goes to its teacher."""

from __future__ import annotations

import random

import torch
from learner_helpers import make_trajectories
from test_advantages import segmented_episode

from k3rl.config import LearnerSection
from k3rl.learner.distill import Teacher, distill_advantages, load_teacher, score
from k3rl.learner.model import K3Config, K3ForCausalLM
from k3rl.learner.model.checkpoint import save_hf
from k3rl.learner.trainer import Trainer

torch.set_num_threads(1)


def tiny(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("k3-tiny")).eval()


def test_scores_are_the_learners_logprobs_segment_by_segment():
    model = tiny(0)
    batch = make_trajectories(0, n=4)
    learner = Trainer(model, LearnerSection(micro_batch_tokens=64, steps=1)).logprobs(batch)
    for got, want in zip(score(model, batch, 64), learner, strict=True):
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-5)
    episode = segmented_episode(random.Random(0), "g", (0.0, 1.0))
    whole = score(model, [episode])[0]
    P = len(episode.prompt_ids)
    for part, (lo, hi) in zip(episode.segments(), episode.segment_bounds, strict=True):
        alone = score(model, [part])[0]  # the segment scored as a sequence of its own
        start = lo + len(part.prompt_ids) - P
        assert torch.allclose(whole[start:hi - P], alone, atol=1e-5)


def test_a_teacher_equal_to_the_behaviour_policy_gives_no_advantage():
    model = tiny(0)
    batch = make_trajectories(1, n=4)
    for t, lp in zip(batch, score(model, batch), strict=True):
        t.logprobs = [float(x) if m else 0.0 for x, m in zip(lp.tolist(), t.loss_mask, strict=True)]
    adv = distill_advantages(batch, torch.zeros(4), [Teacher(model)])
    assert adv.abs().max().item() < 1e-5


def test_each_env_goes_to_its_teacher_and_mixes_with_the_env_advantage(tmp_path):
    a, b = tiny(1), tiny(2)
    save_hf(a, tmp_path / "a")
    teacher_a = load_teacher(str(tmp_path / "a"), "k3-tiny", envs=["e/A"], coef=0.5)  # from its checkpoint
    teachers = [teacher_a, Teacher(b)]  # b: every other env
    batch = make_trajectories(2, n=6)
    envs = ["e/A", "e/B", "e/C", "e/A", "e/B", "e/C"]
    for t, e in zip(batch, envs, strict=True):
        t.env_id = e
    env_adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5])
    adv = distill_advantages(batch, env_adv, teachers)
    assert adv.shape == (6, max(len(t.completion_ids) for t in batch))
    for i, t in enumerate(batch):
        log_t = score(a if t.env_id == "e/A" else b, [t])[0]
        coef = 0.5 if t.env_id == "e/A" else 1.0
        mask = torch.tensor(t.loss_mask, dtype=torch.float32)
        want = env_adv[i] + coef * (log_t - torch.tensor(t.logprobs, dtype=torch.float32)) * mask
        assert torch.allclose(adv[i, :len(t.completion_ids)], want, atol=1e-4)
    only_a = distill_advantages(batch, env_adv, [teacher_a])  # no teacher for B and C: the env's advantage
    for i in (1, 2, 4, 5):
        assert torch.equal(only_a[i], env_adv[i].expand(adv.shape[1]))
