"""The trainer on the real k3-tiny model: steps, schedule, replay, QB, checkpoints, export."""

from __future__ import annotations

import math

import pytest
import torch
from learner_helpers import make_trajectories

from k3rl.config import JobConfig, LearnerSection
from k3rl.learner.trainer import Trainer, lr_at
from k3rl.learner.update import sft_lr_at
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.state_dict_adapter import from_hf

torch.set_num_threads(1)


def tiny(seed=0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config.preset("k3-tiny"))


def trainer(seed=0, **cfg) -> Trainer:
    cfg.setdefault("micro_batch_tokens", 64)
    cfg.setdefault("steps", 10)
    return Trainer(tiny(seed), LearnerSection(**cfg))


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_lr_schedule_linear_warmup_then_cosine():
    peak = 1.0
    assert lr_at(0, 100, peak, 0.05, 0.1) == pytest.approx(0.2)  # warmup 5 steps: (0+1)/5
    assert lr_at(4, 100, peak, 0.05, 0.1) == pytest.approx(1.0)
    assert lr_at(5, 100, peak, 0.05, 0.1) == pytest.approx(1.0)  # cosine starts at the peak
    mid = 5 + 95 / 2
    assert lr_at(int(mid), 100, peak, 0.05, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert lr_at(100, 100, peak, 0.05, 0.1) == pytest.approx(0.1)
    assert lr_at(500, 100, peak, 0.05, 0.1) == pytest.approx(0.1)  # stays at the floor
    assert lr_at(0, 20, 3e-3, 0.01, 0.1) == pytest.approx(3e-3)  # ceil(0.2) = 1 warmup step


def test_sft_rate_is_one_cosine_restarted_by_the_phases_that_set_lr():
    """learner.sft_phases[k].lr restarts the SFT cosine at its peak; a phase without lr continues the
    running one (here: 0-99 at sft_lr 3e-3, then 100-139 restarted at 1e-3, the careless phase at 120
    inside it)."""
    phases = [{"from_step": 100, "lr": 1e-3, "env_kwargs": {"x": 1}}, {"from_step": 120, "env_kwargs": {"x": 2}}]
    cfg = LearnerSection(sft_steps=140, sft_lr=3e-3, sft_warmup_ratio=0.0, min_lr_ratio=0.1, sft_phases=phases)
    lrs = [sft_lr_at(i, cfg) for i in range(140)]
    assert lrs[:100] == [lr_at(i, 100, 3e-3, 0.0, 0.1) for i in range(100)]
    assert lrs[100:] == [lr_at(i, 40, 1e-3, 0.0, 0.1) for i in range(40)]
    assert lrs[100] == pytest.approx(1e-3) and lrs[99] < 0.31e-3  # the restart
    # without a phase that sets lr: the one cosine over all sft_steps
    plain = LearnerSection(sft_steps=140, sft_lr=3e-3, sft_phases=[{"from_step": 100, "env_kwargs": {"x": 1}}])
    assert [sft_lr_at(i, plain) for i in range(140)] == [lr_at(i, 140, 3e-3, plain.sft_warmup_ratio, 0.1)
                                                         for i in range(140)]
    # a first phase at step 0 with lr sets the first peak
    first = LearnerSection(sft_steps=10, sft_lr=3e-3, sft_warmup_ratio=0.0,
                           sft_phases=[{"from_step": 0, "lr": 5e-3, "envs": ["a"]}])
    assert sft_lr_at(0, first) == pytest.approx(5e-3)


def test_train_step_reports_every_term_and_changes_the_weights():
    t = trainer(kl_coef=0.05)
    before = params(t)
    m = t.train_step(make_trajectories(0))
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_masked_frac", "tis_truncated_frac",
                "is_ratio_mean", "is_ratio_max", "grad_norm", "lr", "tokens", "micro_batches"):
        assert key in m and math.isfinite(m[key]), key
    assert m["kl"] == 0.0  # the policy is still the reference
    assert m["entropy"] == pytest.approx(math.log(320), rel=0.05)  # near-uniform at init
    assert m["micro_batches"] > 1 and t.step == 1
    assert 1.0 < m["is_ratio_max"] and m["tis_truncated_frac"] > 0  # behaviour log-probs below the policy's
    after = params(t)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(before["model.layers.1.mlp.gate.e_score_correction_bias"],
                       after["model.layers.1.mlp.gate.e_score_correction_bias"])  # QB frozen by default
    m2 = t.train_step(make_trajectories(1, version=0))
    assert m2["kl"] > 0 and "staleness_mean" not in m2  # staleness has one convention: k3rl.metrics


def test_gradient_accumulation_equals_one_big_micro_batch():
    a, b = trainer(micro_batch_tokens=4096), trainer(micro_batch_tokens=40)
    batch = make_trajectories(2)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["micro_batches"] == 1 and mb["micro_batches"] > 2
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    pa, pb = params(a), params(b)
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-5


def test_resume_is_bit_identical():
    batches = [make_trajectories(s) for s in range(4)]
    a = trainer(steps=6, kl_coef=0.1)
    a.sft_step(batches[0])
    a.train_step(batches[1])
    a.data_state = {"cursor": 17}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        a.save_checkpoint(d)
        ref = [a.train_step(batches[2]), a.train_step(batches[3])]
        b = trainer(seed=123, steps=6, kl_coef=0.1)  # other initial weights: everything comes from the checkpoint
        b.load_checkpoint(d)
        assert b.step == 1 and b.sft_step_count == 1 and b.data_state == {"cursor": 17}
        got = [b.train_step(batches[2]), b.train_step(batches[3])]
    for r, g in zip(ref, got, strict=True):
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "lr", "is_ratio_mean"):
            assert r[key] == g[key], key
        assert r["kl"] > 0
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            va, vb = sa[i][k], sb[i][k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
    assert a.data_position == b.data_position


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="trainer.json"):
        trainer().load_checkpoint(tmp_path)


def test_sft_and_rl_steps_warm_up_apart():
    """learner.sft_warmup_ratio ramps the SFT rate, warmup_ratio the RL steps' (the demo's RL warmup of 0.2
    once ramped its SFT too: 26 of 130 steps, a warm start that copied less)."""
    t = trainer(sft_steps=10, sft_lr=1e-3, steps=10, lr=1e-4, warmup_ratio=0.5, sft_warmup_ratio=0.01)
    assert t.sft_step(make_trajectories(5, n=4))["lr"] == pytest.approx(1e-3)  # one warmup step: the peak
    assert t.train_step(make_trajectories(6, n=4))["lr"] == pytest.approx(1e-4 / 5)  # 5 warmup steps


def test_sft_lowers_the_nll_of_demonstrations():
    t = trainer(sft_steps=6, sft_lr=3e-3)
    demos = make_trajectories(5, n=4)
    first = t.sft_step(demos)["nll"]
    for _ in range(5):
        last = t.sft_step(demos)["nll"]
    assert last < first - 0.5, (first, last)


def test_routing_replay_uses_the_recorded_experts():
    model = tiny()
    n_moe, k = len(model.moe_layer_ids), model.config.num_experts_per_token
    batch = make_trajectories(3, n=4)
    own, forced = [], []
    with torch.no_grad():
        for tr in batch:
            ids = torch.tensor([tr.prompt_ids + tr.completion_ids])
            _, routes = model(ids, return_routing=True)
            P = len(tr.prompt_ids)
            own.append(tr.model_copy(update={"routed_experts": routes[0, P:].tolist()}))
            forced.append(tr.model_copy(update={"routed_experts": [[[0, 1]] * n_moe] * len(tr.completion_ids)}))
    assert len(own[0].routed_experts[0]) == n_moe and len(own[0].routed_experts[0][0]) == k
    base = trainer().train_step(batch)["loss"]
    replay_own = trainer(routing_replay=True).train_step(own)["loss"]
    replay_forced = trainer(routing_replay=True).train_step(forced)["loss"]
    no_replay = trainer(routing_replay=False).train_step(forced)["loss"]
    assert replay_own == pytest.approx(base, abs=1e-5)  # the model's own routes: same result
    assert no_replay == pytest.approx(base, abs=1e-6)  # records ignored when replay is off
    assert abs(replay_forced - base) > 1e-4  # other experts: another function


def test_quantile_balancing_updates_only_when_unfrozen():
    t = trainer(qb_frozen=False)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    before = params(t)[bias]
    m = t.train_step(make_trajectories(4))
    assert m["qb_layers_updated"] == len(t.model.moe_layer_ids)
    after = params(t)[bias]
    assert not torch.equal(before, after)
    assert after.sum().abs().item() < 1e-5  # mean-centred


def test_activation_checkpointing_gives_the_same_step_and_bf16_is_close():
    batch = make_trajectories(6)
    plain, ckpt = trainer(), trainer(activation_checkpointing=True)
    mp, mc = plain.train_step(batch), ckpt.train_step(batch)
    assert ckpt.model.gradient_checkpointing
    assert mp["loss"] == mc["loss"] and mp["grad_norm"] == pytest.approx(mc["grad_norm"], rel=1e-6)
    pp, pc = params(plain), params(ckpt)
    assert max((pp[k] - pc[k]).abs().max().item() for k in pp) < 1e-6
    mb = trainer(bf16=True).train_step(batch)
    assert math.isfinite(mb["loss"]) and mb["entropy"] == pytest.approx(mp["entropy"], rel=2e-2)


def test_export_weights_uses_official_names_and_keeps_fp32_allow_list():
    t = trainer()
    update = t.export_weights(version=7, dtype=torch.bfloat16)
    assert update.version == 7
    state = update.state_dict()
    L, M = "language_model.model.layers.", "language_model.model.layers.1.block_sparse_moe."
    assert f"{M}experts.0.w1.weight" in state and not any(".experts.w1" in n for n in state)
    assert state[f"{L}0.self_attn.A_log"].shape == (128,)  # zero-padded to 128 as in the checkpoint
    assert state[f"{L}0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for name in (f"{L}0.self_attn.A_log", f"{L}0.self_attn.dt_bias",
                 f"{L}0.self_attn.q_conv1d.weight", f"{M}gate.e_score_correction_bias"):
        assert state[name].dtype == torch.float32, name
    exact = t.export_weights(version=8).state_dict()
    ours, unexpected = from_hf(exact, t.model.state_dict())
    assert not unexpected
    own = t.model.state_dict()
    assert ours.keys() == own.keys() and all(torch.equal(ours[k], own[k]) for k in own)


def test_bad_batches_and_config_raise_clear_errors():
    t = trainer()
    batch = make_trajectories(0, n=2)
    batch[0].group_id = ""
    with pytest.raises(ValueError, match="group_id"):
        t.train_step(batch)
    with pytest.raises(ValueError, match="no trajectories"):
        t.sft_step([])
    with pytest.raises(ValueError, match="world_size"):
        Trainer(tiny(), LearnerSection(data_parallel="fsdp", world_size=2))


def test_trainer_from_job_config():
    job = JobConfig.from_dict({"learner": {"optimizer": "adamw", "lr": 1e-3}})
    t = Trainer.from_job(job)
    assert all(g["kind"] == "adamw" for g in t.optimizer.param_groups)
    assert t.model.config == K3Config.preset("k3-tiny")


@pytest.mark.parametrize("algorithm,advantage,tis_level,loss_agg", [
    ("cispo", "grpo_no_std", "sequence", "seq_mean"),
    ("ppo", "rloo", "none", "token_mean"),
])
def test_other_objectives_train(algorithm, advantage, tis_level, loss_agg):
    t = trainer(algorithm=algorithm, advantage=advantage, tis_level=tis_level, loss_agg=loss_agg)
    m = t.train_step(make_trajectories(8))
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    if algorithm == "ppo":  # the behaviour policy is the old policy: the clip sees the real ratio
        assert m["is_ratio_mean"] == 1.0 and m["clip_frac"] > 0


def test_the_policy_at_the_sampling_temperature_is_what_the_engine_reports():
    """An engine sampling at temperature 0.6 (top-k 8) reports log softmax(logits / 0.6) of its tokens;
    a Trainer at temperature 0.6 scores them the same (the ratio is 1 on policy), one at 1 does not;
    SFT stays maximum likelihood at temperature 1 whatever the policy temperature."""
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.types import SamplingParams, Trajectory

    model = tiny(3)
    with EmbeddedEngine(model, max_num_seqs=2) as engine:
        prompt = list(range(40, 72))
        r = engine.generate(prompt, SamplingParams(temperature=0.6, top_k=8, max_tokens=20, seed=4))
    C = len(r.token_ids)
    tr = Trajectory(env_id="test/Synthetic-v0", group_id="g", prompt_ids=prompt, completion_ids=list(r.token_ids),
                    logprobs=list(r.logprobs), loss_mask=[1] * C, versions=[0] * C, reward=1.0)
    hot = Trainer(model, LearnerSection(micro_batch_tokens=128, steps=1), temperature=0.6)
    got = torch.tensor(hot.logprobs([tr])[0], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(r.logprobs, dtype=torch.float64), rtol=0, atol=2e-5)
    cold = torch.tensor(Trainer(model, LearnerSection(micro_batch_tokens=128, steps=1)).logprobs([tr])[0], dtype=torch.float64)
    assert (cold - got).abs().max() > 1e-2
    with pytest.raises(ValueError, match="policy temperature must be > 0"):
        Trainer(model, LearnerSection(steps=1), temperature=0.0)
    assert JobConfig.load(None, ["rollout.sampling.temperature=0"]).rollout.sampling.policy_temperature == 1.0


def test_logprobs_of_completion_tokens_match_a_direct_forward():
    t = trainer()
    batch = make_trajectories(10, n=3)
    got = t.logprobs(batch)
    for tr, lp in zip(batch, got, strict=True):
        ids = torch.tensor([tr.prompt_ids + tr.completion_ids])
        with torch.no_grad():
            logits = t.model(ids)[0].float()
        P = len(tr.prompt_ids)
        ref = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, ids[0, P:, None])[:, 0]
        ref = ref * torch.tensor(tr.loss_mask)
        assert len(lp) == len(tr.completion_ids)
        assert torch.allclose(torch.tensor(lp, dtype=torch.float32), ref, atol=1e-4)


def _image_trajectory(model, color, seed=0):
    import random

    from PIL import Image

    from k3rl.images import to_png
    from k3rl.types import Trajectory, Turn

    img = Image.new("RGB", (56, 42), color)
    pads = int(model.as_media([img]).tokens_per_item()[0])
    pad_id = model.config.media_placeholder_token_id
    rng = random.Random(seed)
    prompt = [1, 2] + [pad_id] * pads + [3]
    C = 12
    return Trajectory(env_id="e", group_id="g", prompt_ids=prompt, completion_ids=[rng.randrange(256) for _ in range(C)],
                      logprobs=[-5.0] * C, loss_mask=[1] * C, versions=[0] * C, reward=float(seed),
                      turns=[Turn(role="user", images=[to_png(img)], start=0, end=len(prompt))])


def test_vision_trajectories_train_the_vision_tower():
    t = trainer()
    batch = [_image_trajectory(t.model, (200, 30, 30), seed=0), _image_trajectory(t.model, (20, 30, 230), seed=1),
             make_trajectories(11, n=1)[0].model_copy(update={"group_id": "g", "reward": 0.5})]
    before = params(t)
    m = t.train_step(batch)
    assert math.isfinite(m["loss"])
    after = params(t)
    assert not torch.equal(before["mm_projector.proj.0.weight"], after["mm_projector.proj.0.weight"])
    assert not torch.equal(before["vision_tower.encoder.blocks.0.wqkv.weight"],
                           after["vision_tower.encoder.blocks.0.wqkv.weight"])
    # the pixels matter: another image changes the policy's log-probs of the same tokens
    other = batch[0].model_copy(update={"turns": batch[1].turns})
    lp_a, lp_b = t.logprobs([batch[0], other])
    assert max(abs(a - b) for a, b in zip(lp_a, lp_b, strict=True)) > 1e-6


def test_qk_clip_caps_the_mla_heads_above_tau():
    t = Trainer(tiny(), LearnerSection(lr=1e-9, micro_batch_tokens=64, steps=10), qk_clip_tau=1e9)
    batch = make_trajectories(12, n=4)

    def maxima():
        with t.max_logits.recording():
            t.logprobs(batch)
        return t.max_logits.pop()

    before = maxima()
    assert len(before) == len(t.model.config.mla_layer_ids)
    heads = torch.cat(list(before.values()))
    tau = float(heads.median())
    t.qk_clip.tau = tau
    m = t.train_step(batch)  # lr ~ 0: the weights move only by the clip
    after = maxima()
    hot = int((heads > tau).sum())
    assert m["qk_clip_heads"] == hot > 0
    assert m["mla_max_logit"] == pytest.approx(float(heads.max()), rel=1e-5)
    first = f"model.layers.{t.model.config.mla_layer_ids[0]}.self_attn"
    for name, s in before.items():
        expect = torch.where(s > tau, torch.full_like(s, tau), s)
        # the first MLA layer sees unchanged inputs: exact; later ones see the clipped layers' outputs
        assert torch.allclose(after[name], expect, rtol=1e-4 if name == first else 2e-2), (name, s, after[name])


# ----- several updates per batch, Dr. GRPO, overlong ------------------------------------------
def test_one_update_per_batch_has_ratio_one_so_the_clip_never_acts():
    m = trainer(lr=3e-2).train_step(make_trajectories(3, n=16))
    assert m["updates"] == 1 and m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0


def test_ppo_epochs_and_minibatches_record_the_old_policy_so_the_clip_acts():
    t = trainer(lr=3e-2, ppo_epochs=2, minibatches=2, micro_batch_tokens=4096)
    before = params(t)
    m = t.train_step(make_trajectories(3, n=16))
    assert m["updates"] == 4 and m["micro_batches"] == 2 and t.step == 1  # one policy version
    assert m["approx_kl"] > 0 and m["clip_frac"] > 0, m  # updates 2-4 see r != 1
    assert m["loss_tokens"] == pytest.approx(sum(sum(x.loss_mask) for x in make_trajectories(3, n=16)))
    assert not torch.equal(before["lm_head.weight"], params(t)["lm_head.weight"])


def test_first_update_of_several_equals_the_single_update():
    """The old policy is recorded before the first update: the first of two epochs is the
    one-update step exactly (r = 1 there), and the second moves further."""
    batch = make_trajectories(4)
    one, two = trainer(lr=1e-2), trainer(lr=1e-2, ppo_epochs=2)
    one.train_step(batch)
    snapshots, step = [], two._clip_and_step

    def step_and_snapshot(lr):  # the weights after each optimizer update of the two-epoch step
        norm = step(lr)
        snapshots.append(params(two))
        return norm

    two._clip_and_step = step_and_snapshot
    m = two.train_step(batch)
    assert m["updates"] == 2 and len(snapshots) == 2
    after_one = params(one)
    assert max((after_one[k] - snapshots[0][k]).abs().max().item() for k in after_one) < 1e-6
    assert max((after_one[k] - snapshots[1][k]).abs().max().item() for k in after_one) > 1e-4


def test_minibatches_are_whole_groups_covering_the_batch_once():
    t = trainer(minibatches=3)
    batch = make_trajectories(5, n=24, group_size=4)
    parts = t._minibatches(list(range(24)), batch)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(24))
    for p in parts:
        assert len({batch[i].group_id for i in p}) * 4 == len(p)  # whole groups of 4
    assert parts == trainer(minibatches=3)._minibatches(list(range(24)), batch)  # same on every rank
    assert trainer(minibatches=9)._minibatches(list(range(24)), batch).__len__() == 6  # at most one part per group


def test_constant_aggregation_is_dr_grpo():
    from k3rl.learner.losses import aggregation_weights

    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0, 0])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])  # sequence 2 has no loss tokens
    w = aggregation_weights(mask, seq, "constant", num_seqs=3, norm_tokens=8)
    assert torch.allclose(w, mask / (8 * 2))  # a_t = 1 / (N_seqs * L), N_seqs counts sequences with loss tokens
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregation_weights(mask, seq, "constant", num_seqs=3)
    m = trainer(loss_agg="constant", loss_norm_tokens=32, advantage="grpo_no_std").train_step(make_trajectories(6))
    assert math.isfinite(m["loss"])


def _cut(batch, which):
    for i in which:
        batch[i].truncated = True
        batch[i].metadata["truncated_by"] = "max_tokens"
    batch[which[-1] + 1].truncated, batch[which[-1] + 1].metadata["truncated_by"] = True, "max_turns"  # not overlong
    return batch


def test_overlong_filter_trains_without_the_cut_episodes():
    batch = _cut(make_trajectories(7, n=8), [0, 5])
    m = trainer(overlong="filter").train_step(batch)
    assert m["sequences"] == 6 and m["overlong_frac"] == pytest.approx(2 / 8)
    kept = [x for i, x in enumerate(batch) if i not in (0, 5)]
    assert m["loss_tokens"] == sum(sum(x.loss_mask) for x in kept)


def test_overlong_penalty_lowers_the_cut_episodes_advantage():
    from k3rl.learner.losses import group_advantages

    batch = _cut(make_trajectories(7, n=8), [0, 5])
    m = trainer(overlong="penalty", overlong_penalty=0.5).train_step(batch)
    shaped = [x.reward - (0.5 if i in (0, 5) else 0.0) for i, x in enumerate(batch)]
    expected = group_advantages(shaped, [x.group_id for x in batch], "grpo").abs().mean()
    assert m["advantage_abs_mean"] == pytest.approx(float(expected), rel=1e-6)
    assert m["sequences"] == 8


def test_format_penalty_lowers_the_advantage_of_malformed_episodes():
    from k3rl.learner.losses import group_advantages

    batch = make_trajectories(8, n=8)
    batch[1].metadata["parse_errors"] = 2
    batch[6].metadata["parse_errors"] = 1
    m = trainer(format_penalty=0.3).train_step(batch)
    shaped = [x.reward - (0.3 if i in (1, 6) else 0.0) for i, x in enumerate(batch)]
    expected = group_advantages(shaped, [x.group_id for x in batch], "grpo").abs().mean()
    assert m["advantage_abs_mean"] == pytest.approx(float(expected), rel=1e-6)
    assert m["malformed_frac"] == pytest.approx(2 / 8) and m["reward_mean"] == pytest.approx(
        sum(x.reward for x in batch) / 8)  # the logged reward is the env's
