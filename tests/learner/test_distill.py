"""On-policy distillation (learner/distill.py) with real k3-tiny teachers: the teacher's scores are
the learner's own log-probs of the sampled tokens, segment by segment; the advantage is
coef * (log T - log mu) on sampled tokens, added to the env's; each env goes to its teacher.
A teacher served by engines of its own (learner/teacher_engines.py, real Ray actors) scores as the learner
would, and its engine dying is an error naming its checkpoint."""

from __future__ import annotations

import random
import re

import pytest
import torch
from learner_helpers import make_trajectories
from test_advantages import segmented_episode
from test_learner_actor import ray_cluster  # noqa: F401  (the fixture: a local Ray for the module)

from k3rl.config import LearnerSection
from k3rl.learner.distill import Teacher, distill_advantages, load_teacher, load_teachers, score
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.checkpoint import save_hf

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
    # at the student's policy temperature the teacher is scored as the learner scores the student: a
    # teacher equal to the student then adds nothing (log T - log mu = 0), where temperature 1 would not
    hot = Trainer(model, LearnerSection(micro_batch_tokens=64, steps=1), temperature=0.7).logprobs(batch)
    for got, want, cold in zip(score(model, batch, 64, 0.7), hot, learner, strict=True):
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-5)
        assert not torch.allclose(got, torch.tensor(cold, dtype=torch.float32), atol=1e-3)
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


def test_the_learners_logprobs_of_a_segmented_episode_are_scored_segment_by_segment():
    model = tiny(0)
    episodes = [segmented_episode(random.Random(s), "g", (0.0, 1.0)) for s in range(2)]
    got = Trainer(model, LearnerSection(micro_batch_tokens=4096, steps=1)).logprobs(episodes)
    for g, e in zip(got, episodes, strict=True):
        assert len(g) == len(e.completion_ids)
        assert torch.allclose(torch.tensor(g, dtype=torch.float32), score(model, [e])[0], atol=1e-5)


def test_a_job_teacher_is_loaded_by_the_trainer_and_enters_the_step(tmp_path):
    save_hf(tiny(3), tmp_path / "t")
    section = LearnerSection(micro_batch_tokens=256, steps=1, optimizer="adamw", lr=1e-4,
                             distill={"teachers": [{"checkpoint": str(tmp_path / "t"), "preset": "k3-tiny",
                                                    "coef": 0.5, "clip": 100.0, "engines": 0}]})
    trainer = Trainer(tiny(0), section)
    assert len(trainer.teachers) == 1 and (trainer.teachers[0].coef, trainer.teachers[0].clip) == (0.5, 100.0)
    batch = make_trajectories(4, n=4)
    env_adv = torch.zeros(4)
    want = distill_advantages(batch, env_adv, trainer.teachers)  # [N, C]: padded past shorter completions
    mask = torch.zeros(want.shape, dtype=torch.bool)
    for i, t in enumerate(batch):
        mask[i, :len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.bool)
    for t in batch:
        t.reward = 1.0  # every reward equal: the env's GRPO advantage is 0, the step's is the teacher's alone
    metrics = trainer.train_step(batch)
    assert abs(metrics["advantage_abs_mean"] - float(want.abs()[mask].mean())) < 1e-4  # over sampled tokens only
    assert metrics["advantage_abs_mean"] > float(want.abs().mean())  # (the padding's zeros would lower it)


def test_teachers_are_checked_before_the_job_starts(tmp_path):
    import json

    from k3rl.config import ConfigError, JobConfig
    from k3rl.rollout.job_start import PreflightError, preflight

    with pytest.raises(ConfigError, match=r"learner.distill.teachers.1.envs: k3rl/KeyLookup-v0 is already taught"):
        JobConfig.from_dict({"learner": {"distill": {"teachers": [
            {"checkpoint": "a", "envs": ["k3rl/KeyLookup-v0"]}, {"checkpoint": "b", "envs": ["k3rl/KeyLookup-v0"]}]}}})

    def job(path, **kw):
        return JobConfig.from_dict({"learner": {"distill": {"teachers": [{"checkpoint": str(path), **kw}]}}})

    with pytest.raises(PreflightError, match=r"learner.distill.teachers.0.checkpoint: .*missing does not exist"):
        preflight(job(tmp_path / "missing"))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(PreflightError, match=r"teachers.0.checkpoint: .* is not a K3-architecture config"):
        preflight(job(tmp_path / "llama"))
    save_hf(tiny(0), tmp_path / "t")
    with pytest.raises(PreflightError, match=r"teachers.0.checkpoint: .* another architecture .* moe_intermediate_size"):
        preflight(job(tmp_path / "t", overrides={"moe_intermediate_size": 32}))


def test_env_coef_zero_is_pure_distillation_on_the_taught_episodes():
    """env_coef scales the env's advantage where a teacher scores: 0 leaves the teacher's term alone there,
    and the episodes no teacher takes keep the env's advantage whole."""
    model = tiny(3)
    batch = make_trajectories(4, n=4)
    for t, e in zip(batch, ["e/A", "e/B", "e/A", "e/B"], strict=True):
        t.env_id = e
    env_adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    teacher = Teacher(model, envs=("e/A",))
    mixed = distill_advantages(batch, env_adv, [teacher])
    pure = distill_advantages(batch, env_adv, [teacher], env_coef=0.0)
    half = distill_advantages(batch, env_adv, [teacher], env_coef=0.5)
    for i in (0, 2):
        torch.testing.assert_close(pure[i], mixed[i] - env_adv[i])
        torch.testing.assert_close(half[i], mixed[i] - 0.5 * env_adv[i])
    for i in (1, 3):
        assert torch.equal(pure[i], env_adv[i].expand(pure.shape[1])) and torch.equal(pure[i], mixed[i])


def test_clip_bounds_each_tokens_log_ratio():
    model = tiny(5)
    batch = make_trajectories(6, n=4)  # behaviour log-probs around -5.5, the teacher's elsewhere
    free = distill_advantages(batch, torch.zeros(4), [Teacher(model)])
    clipped = distill_advantages(batch, torch.zeros(4), [Teacher(model, clip=0.5)])
    assert free.abs().max() > 0.5
    assert torch.allclose(clipped, free.clamp(-0.5, 0.5))


def test_discount_sums_the_later_sampled_tokens_log_ratios():
    from k3rl.learner.distill import returns_to_go

    r = torch.tensor([1.0, 2.0, 9.0, 4.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])  # position 2 is tool output: no r, not a step of the discount
    assert torch.equal(returns_to_go(r, mask, 0.0), torch.tensor([1.0, 2.0, 0.0, 4.0]))
    # G_3 = 4, G_1 = 2 + 0.5 * 4 = 4, G_0 = 1 + 0.5 * 4 = 3
    assert torch.allclose(returns_to_go(r, mask, 0.5), torch.tensor([3.0, 4.0, 0.0, 4.0]))
    assert torch.allclose(returns_to_go(r, mask, 1.0), torch.tensor([7.0, 6.0, 0.0, 4.0]))

    model = tiny(5)
    batch = make_trajectories(6, n=4)
    own = distill_advantages(batch, torch.zeros(4), [Teacher(model, clip=0.5)])
    whole = distill_advantages(batch, torch.zeros(4), [Teacher(model, clip=0.5, discount=1.0)])
    for i, t in enumerate(batch):  # gamma = 1: each sampled token carries the sum of its own and every later r
        m = torch.tensor(t.loss_mask, dtype=torch.bool)
        n = len(t.loss_mask)
        want = own[i, :n].flip(0).cumsum(0).flip(0)
        assert torch.allclose(whole[i, :n][m], want[m], atol=1e-5)
        assert torch.all(whole[i, :n][~m] == 0)


# ----- estimator: exact, the per-token reverse KL over the vocabulary --------------------------------
def test_the_chunked_reverse_kl_is_the_kl_of_the_two_softmaxes_in_value_and_gradient():
    from k3rl.model.logprobs import chunked_reverse_kl

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, 16, generator=g, requires_grad=True), torch.randn(50, 16, generator=g, requires_grad=True)
    th, tw = torch.randn(37, 24, generator=g), torch.randn(50, 24, generator=g)  # a teacher of another width
    upstream = torch.rand(37, generator=g)
    for tau in (1.0, 0.7):
        log_p = torch.log_softmax(h @ w.t() / tau, -1)
        log_q = torch.log_softmax(th @ tw.t() / tau, -1)
        want = (log_p.exp() * (log_p - log_q)).sum(-1)
        dh, dw = torch.autograd.grad((want * upstream).sum(), (h, w))
        got = chunked_reverse_kl(h, w, th, tw, chunk_tokens=8, temperature=tau)  # 5 chunks, the last short
        gh, gw = torch.autograd.grad((got * upstream).sum(), (h, w))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gh, dh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gw, dw, atol=1e-5, rtol=1e-5)
        assert (got >= -1e-6).all()
    assert chunked_reverse_kl(h, w, h.detach(), w.detach()).abs().max() < 1e-5  # a teacher equal to the student
    with pytest.raises(ValueError, match="same positions and vocabulary"):
        chunked_reverse_kl(h, w, th[:5], tw)


def test_the_exact_kl_gradient_is_the_expected_gradient_of_the_sampled_estimator():
    """At one position, E_{y ~ p}[(log q(y) - log p(y)) grad log p(y)] = -grad KL(p || q): the sampled
    advantage (discount 0) is a one-sample estimate of the exact term's gradient (learner/distill.py)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(12, generator=g, requires_grad=True)
    log_q = torch.log_softmax(torch.randn(12, generator=g), -1)
    log_p = torch.log_softmax(z, -1)
    (exact,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), z, retain_graph=True)
    p = log_p.exp().detach()
    expected = sum(p[y] * (log_q[y] - log_p[y]).detach() * torch.autograd.grad(log_p[y], z, retain_graph=True)[0]
                   for y in range(12))
    torch.testing.assert_close(expected, -exact, atol=1e-6, rtol=1e-5)


def test_exact_teachers_are_refused_where_they_cannot_work():
    from k3rl.config import ConfigError, JobConfig

    def teacher(**kw):
        return JobConfig.from_dict({"learner": {"distill": {"teachers": [{"checkpoint": "t", "estimator": "exact", **kw}]}}})

    with pytest.raises(ConfigError, match=r"learner.distill.teachers.0.engines: .*whole distribution.*set engines: 0"):
        teacher()
    with pytest.raises(ConfigError, match=r"teachers.0.clip: .*remove clip"):
        teacher(engines=0, clip=1.0)
    with pytest.raises(ConfigError, match=r"teachers.0.discount: .*set discount: 0"):
        teacher(engines=0, discount=1.0)
    assert teacher(engines=0).learner.distill.teachers[0].estimator == "exact"


def test_an_exact_teacher_adds_its_kl_to_the_loss_and_pulls_the_student_to_it(tmp_path):
    """The exact term's gradient is coef x grad sum_t a_t KL(pi || T)_t (a teacher equal to the student
    adds nothing); the env's advantage of its episodes is scaled by env_coef, not added to; and pure
    distillation steps bring the student's distribution to the teacher's."""
    from k3rl.model.logprobs import chunked_reverse_kl

    save_hf(tiny(3), tmp_path / "t")
    save_hf(tiny(0), tmp_path / "same")

    def trainer(checkpoint, env_coef=1.0, lr=1e-3, coef=0.5):
        return Trainer(tiny(0), LearnerSection(
            micro_batch_tokens=256, steps=4, optimizer="adamw", lr=lr, warmup_ratio=0.0, kl_coef=0.0,
            distill={"env_coef": env_coef, "teachers": [{"checkpoint": str(tmp_path / checkpoint), "coef": coef,
                                                         "estimator": "exact", "engines": 0}]}))

    def grads(tr, batch):
        tr.optimizer.zero_grad(set_to_none=True)
        tr._clip_and_step = lambda lr: 0.0  # keep the gradients: read them instead of stepping
        metrics = tr.train_step(batch)
        return metrics, {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}

    batch = make_trajectories(4, n=4)
    for t, r in zip(batch, [1.0, 0.0, 1.0, 0.0], strict=True):
        t.reward, t.group_id = r, "g"
    plain = Trainer(tiny(0), LearnerSection(micro_batch_tokens=256, steps=4, optimizer="adamw",
                                            warmup_ratio=0.0, kl_coef=0.0))
    _, want = grads(plain, batch)
    metrics, same = grads(trainer("same"), batch)  # the teacher is the student: KL 0, the RL gradient alone
    assert metrics["distill_kl"] < 1e-5
    for n in want:
        torch.testing.assert_close(same[n], want[n], atol=1e-6, rtol=1e-5)

    # pure distillation (env_coef 0): the gradient is coef x d/dtheta sum_t a_t KL_t, a_t = 1 / (taught tokens)
    tr = trainer("t", env_coef=0.0)
    metrics, got = grads(tr, batch)
    teacher = tr.teachers[0].model
    student = tiny(0)
    total, n_tok = 0.0, 0
    for t in batch:
        ids = torch.tensor([t.token_ids])
        h = student(ids, return_hidden=True)[0, :-1]
        th = teacher(ids, return_hidden=True)[0, :-1]
        kl = chunked_reverse_kl(h, student.lm_head.weight, th, teacher.lm_head.weight)
        m = torch.zeros(len(t.token_ids) - 1)
        m[len(t.prompt_ids) - 1:] = torch.tensor(t.loss_mask, dtype=torch.float32)
        total, n_tok = total + (kl * m).sum(), n_tok + m.sum()
    (0.5 * total / n_tok).backward()
    assert abs(metrics["distill_kl"] - float(total.detach() / n_tok)) < 1e-4
    for n, p in student.named_parameters():
        if n in got:
            torch.testing.assert_close(got[n], p.grad, atol=1e-5, rtol=1e-3)

    tr = trainer("t", env_coef=0.0, lr=3e-3, coef=1.0)
    kls = [tr.train_step(batch)["distill_kl"] for _ in range(4)]
    assert kls[-1] < 0.5 * kls[0], kls


# ----- teachers served by engines of their own (learner/teacher_engines.py) ----------------------------------
def _job(*teachers: dict):
    from k3rl.config import JobConfig

    return JobConfig.from_dict({"learner": {"micro_batch_tokens": 64, "distill": {"teachers": list(teachers)}}})


def _live_teacher_engines(deadline_s: float = 30.0) -> int:
    """TeacherEngine actors not dead (after giving killed ones a moment to go)."""
    import time

    from ray._private.state import actors

    t = time.monotonic()
    while True:
        live = sum(a["ActorClassName"] == "TeacherEngine" and a["State"] != "DEAD" for a in actors().values())
        if not live or time.monotonic() - t > deadline_s:
            return live
        time.sleep(0.5)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.slow
def test_a_teacher_on_engines_of_its_own_scores_as_the_learner_does(tmp_path):
    """Teacher a on 2 engines of its own (e/A), teacher b in the learner (the rest): the engines attach
    the learner's own log-probs of a (a segmented episode too), and the advantages equal the
    in-learner path's on the same batch."""
    import asyncio

    import ray

    from k3rl.learner.teacher_engines import TeacherGroup

    a, b = tiny(1), tiny(2)
    save_hf(a, tmp_path / "a")
    save_hf(b, tmp_path / "b")
    cfg = _job({"checkpoint": str(tmp_path / "a"), "envs": ["e/A"], "coef": 0.5, "engines": 2},
               {"checkpoint": str(tmp_path / "b"), "engines": 0})
    batch = [*make_trajectories(7, n=5), segmented_episode(random.Random(3), "g", (0.0, 1.0))]
    for t, e in zip(batch, ["e/A", "e/B", "e/A", "e/B", "e/A", "e/A"], strict=True):
        t.env_id = e
    group = TeacherGroup(cfg)

    async def main():
        await group.wait_ready()
        return await group.score(ray.put(batch))

    try:
        scored_ref, metrics = asyncio.run(main())
        scored = ray.get(scored_ref)
    finally:
        group.shutdown()
    assert metrics["distill/episodes_scored"] == 4 and metrics["time/teacher_s"] > 0
    for t, s in zip(batch, scored, strict=True):
        if t.env_id == "e/A":
            got = torch.tensor(s.metadata["teacher_logprobs"])
            assert torch.allclose(got, score(a, [t])[0], atol=1e-5)
        else:  # teacher b is the learner's to score
            assert "teacher_logprobs" not in s.metadata
    teachers = load_teachers(cfg.learner.distill.teachers)  # a: no model (its engines scored), b: loaded here
    assert teachers[0].model is None and teachers[1].model is not None
    env_adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5])
    want = distill_advantages(batch, env_adv, [Teacher(a, ("e/A",), coef=0.5), Teacher(b)])  # all in the learner
    assert torch.allclose(distill_advantages(scored, env_adv, teachers), want, atol=1e-5)
    with pytest.raises(ValueError, match=f"teacher {re.escape(str(tmp_path / 'a'))} is served by engines .* engines: 0"):
        distill_advantages(batch, env_adv, teachers)  # not scored by a's engines: the learner cannot
    assert _live_teacher_engines() == 0


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.slow
def test_a_teacher_engine_dying_or_not_starting_is_named_by_its_checkpoint(tmp_path):
    import asyncio

    import ray

    from k3rl.learner.teacher_engines import TeacherError, TeacherGroup

    save_hf(tiny(1), tmp_path / "a")
    group = TeacherGroup(_job({"checkpoint": str(tmp_path / "a")}))
    try:
        asyncio.run(group.wait_ready())
        ray.kill(group.engines[0], no_restart=True)
        with pytest.raises(TeacherError, match=re.escape(f"learner.distill.teachers.0 ({tmp_path / 'a'}) engine 0 died")):
            asyncio.run(group.score(ray.put(make_trajectories(0, n=2))))
    finally:
        group.shutdown()
    # a checkpoint its engine cannot load (another architecture than the preset): named at start
    bad = TeacherGroup(_job({"checkpoint": str(tmp_path / "a"), "overrides": {"moe_intermediate_size": 32}}))
    try:
        with pytest.raises(TeacherError, match=re.escape(f"teachers.0 ({tmp_path / 'a'}) engine 0 did not start")):
            asyncio.run(bad.wait_ready())
    finally:
        bad.shutdown()
    assert _live_teacher_engines() == 0
