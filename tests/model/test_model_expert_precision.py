"""`model.expert_precision: mxfp4` (K3's precision recipe, k3rl/model/moe.py): the setting and its refusals,
the straight-through gradient of the quantised expert GEMMs, and that the embedded engine and the learner
compute the same model under it."""

from __future__ import annotations

import copy

import pytest
import torch

from k3rl.config import ConfigError, JobConfig
from k3rl.kernels.situ import situ_glu
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM, build_model, mx, mxfp4
from k3rl.model.moe import RoutedExperts
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.engine.decode import _routed_experts
from k3rl.types import SamplingParams, Trajectory, WeightUpdate


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, list(overrides))
    return str(e.value)


def test_the_setting_reaches_the_model_and_bad_values_are_refused_by_path():
    assert JobConfig.load(None, []).model.k3_config().expert_precision == "bf16"
    cfg = JobConfig.load(None, ["model.expert_precision=mxfp4"])
    assert cfg.model.k3_config().expert_precision == "mxfp4"
    assert cfg.model.k3_overrides["expert_precision"] == "mxfp4"  # what the engines and the learner build from
    assert "model.expert_precision: Input should be 'bf16' or 'mxfp4' (got 'fp8')" in _refusal("model.expert_precision=fp8")
    assert "model.overrides.expert_precision: set model.expert_precision instead" in _refusal(
        "model.overrides.expert_precision=mxfp4")
    msg = _refusal("model.expert_precision=mxfp4", "model.overrides.moe_intermediate_size=48")
    assert "moe_intermediate_size (48) must be multiples of 32" in msg
    msg = _refusal("model.expert_precision=mxfp4", "learner.expert_parallel=2", "learner.data_parallel=fsdp",
                   "learner.world_size=2")
    assert "learner.expert_parallel: learner.expert_parallel=2 shards the routed experts" in msg


def test_the_full_preset_builds_on_meta_with_mxfp4_experts():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.preset("k3").model_copy(update={"expert_precision": "mxfp4"}))
    assert model.model.layers[1].mlp.experts.precision == "mxfp4"
    assert build_model("k3-tiny", {"expert_precision": "mxfp4"}, device="meta").config.expert_precision == "mxfp4"


def _routed(config: K3Config, seed: int = 0):
    """RoutedExperts of `config` with N(0, 0.02) weights, and a batch routed to them: (experts, z, idx, p)."""
    torch.manual_seed(seed)
    experts = RoutedExperts(config)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=0.02)
    N, E, k = 7, config.num_experts, config.num_experts_per_token
    z = torch.randn(N, config.routed_expert_hidden_size)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    p = torch.softmax(torch.randn(N, k), -1)
    return experts, z, idx, p


def test_the_straight_through_gradient_is_the_plain_gemms_gradient_at_the_quantised_point():
    """Autograd through RoutedExperts under mxfp4 gives the master weights and z exactly the gradient
    that the unquantised expert formula has at the quantised values (the quantisation steps pass the
    gradient on unchanged), and the forward is that formula's value there."""
    config = K3Config.preset("k3-tiny").model_copy(update={"expert_precision": "mxfp4"})
    experts, z, idx, p = _routed(config)
    z.requires_grad_(True)
    u = experts(z, idx, p)
    g = torch.randn_like(u)
    (u * g).sum().backward()
    # the reference: leaves at the quantised values, plain GEMMs, the mid activation's rounding a constant
    zq = mx.fake_mxfp8(z.detach()).requires_grad_(True)
    w1q, w3q, w2q = (mx.fake_mxfp4(w.detach()).requires_grad_(True) for w in (experts.w1, experts.w3, experts.w2))
    rows = []
    for n in range(z.shape[0]):
        h = 0
        for j, e in enumerate(idx[n].tolist()):
            a = situ_glu(zq[n : n + 1] @ w1q[e].T, zq[n : n + 1] @ w3q[e].T, experts.beta_gate, experts.beta_up,
                         backend="torch")
            a = a + (mx.fake_mxfp8(a.detach()) - a.detach())  # MXFP8 values, identity gradient
            h = h + p[n, j] * (a @ w2q[e].T)
        rows.append(h)
    ref = torch.cat(rows)
    (ref * g).sum().backward()
    torch.testing.assert_close(u, ref, rtol=1e-6, atol=1e-7)
    for got, want in ((experts.w1.grad, w1q.grad), (experts.w3.grad, w3q.grad), (experts.w2.grad, w2q.grad),
                      (z.grad, zq.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
        assert got.abs().max() > 0
    # and the quantisation is in effect: the bf16 path (no rounding) computes something else
    plain = RoutedExperts(config.model_copy(update={"expert_precision": "bf16"}))
    plain.load_state_dict(experts.state_dict())
    assert (plain(z.detach(), idx, p) - u.detach()).abs().max() > 1e-3 * u.abs().max()



def test_the_engine_and_the_learner_compute_the_same_model_under_mxfp4():
    """k3-tiny, fp32. An embedded engine built from the same preset and precision (another seed), holding the
    learner's weights synced with the experts in MXFP4 (as the release stores them), computes each MoE layer's
    routed experts bit for bit as the learner does on its fp32 master weights; then it samples completions
    and the Trainer scores the same tokens. Most tokens agree to fp32 noise, as under bf16 precision; a few
    differ more: the engine's decode path (recurrent KDA, one token at a time) and the learner's full-sequence
    forward differ upstream by ~1e-7, and an activation that close to an MXFP8 rounding midpoint rounds to the
    neighbouring E4M3 value on one side (a ~6% step in one element). Measured here (3 x 48 tokens): median
    |engine - learner| 4.8e-7, max 5.2e-5; over 6 x 64 tokens: max 3.0e-4, 3 of 384 above 1e-4, 15 above 1e-5
    (bf16 precision on the same tokens: max 1.4e-6, none above 1e-5)."""
    cfg = JobConfig.load(None, ["model.expert_precision=mxfp4", "learner.micro_batch_tokens=512", "learner.steps=1"])
    trainer = Trainer.from_job(cfg)
    learner_moe = [layer.mlp.experts for layer in trainer.model.model.layers if layer.is_moe]
    trs = []
    with EmbeddedEngine.from_preset(cfg.model.preset, overrides=cfg.model.k3_overrides, seed=cfg.model.seed + 1,
                                    max_num_seqs=2) as engine:
        engine.update_weights(trainer.export_weights(1, experts="mxfp4"))
        engine_moe = [layer.mlp.experts for layer in engine.model.model.layers if layer.is_moe]
        _, z, idx, p = _routed(trainer.model.config)
        few = torch.tensor([[1, 5], [6, 1], [5, 6], [6, 5], [1, 6], [5, 1], [1, 5]])  # the engine reads 3 experts
        with torch.no_grad():
            for theirs, ours in zip(engine_moe, learner_moe, strict=True):
                assert torch.equal(_routed_experts(theirs, z, idx, p), ours(z, idx, p))
                assert torch.equal(_routed_experts(theirs, z, few, p), ours(z, few, p))
        for s in range(3):
            prompt = list(range(40 + s, 72 + s))
            r = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=48, seed=s))
            C = len(r.token_ids)
            trs.append(Trajectory(env_id="test/Synthetic-v0", group_id="g", prompt_ids=prompt,
                                  completion_ids=list(r.token_ids), logprobs=list(r.logprobs), loss_mask=[1] * C,
                                  versions=[1] * C, reward=1.0))
    engine_lp = torch.cat([torch.tensor(t.logprobs, dtype=torch.float64) for t in trs])

    def diff(t: Trainer) -> torch.Tensor:
        return (torch.cat([torch.tensor(lp, dtype=torch.float64) for lp in t.logprobs(trs)]) - engine_lp).abs()

    d = diff(trainer)
    plain = Trainer(copy.deepcopy(trainer.model), cfg.learner)  # the same weights, the experts unquantised
    for m in plain.model.modules():
        if isinstance(m, RoutedExperts):
            m.precision = "bf16"
    print(f"max |engine - learner| {d.max():.2e}, median {d.median():.2e}, above 1e-4: {int((d > 1e-4).sum())} "
          f"of {d.numel()}; a bf16-precision learner: median {diff(plain).median():.2e}")
    assert d.numel() == 3 * 48
    assert d.median() < 2e-6 and (d > 1e-4).float().mean() < 0.05 and d.max() < 2e-3
    assert diff(plain).median() > 100 * d.median()


def test_the_weight_sync_sends_mxfp4_experts_and_the_engine_holds_them_as_mxfp4():
    """The default weight update of an mxfp4 learner carries the routed experts as the release stores them
    (weight_packed + weight_scale); an engine under mxfp4 holds them as those bytes (no dense expert weights)
    and its values are exactly those the learner's forward quantises its fp32 master weights to, in a bf16
    engine too; a partial update changes only the experts it carries. A bf16 learner sends them dense."""
    cfg = JobConfig.load(None, ["model.expert_precision=mxfp4", "learner.steps=1"])
    trainer = Trainer.from_job(cfg)
    update = trainer.export_weights(1, dtype=torch.bfloat16)  # the engines' dtype in a GPU job
    sent = update.state_dict()
    experts = [n for n in sent if ".experts." in n]
    assert experts and all(n.endswith((".weight_packed", ".weight_scale")) for n in experts)
    assert all(sent[n].dtype == torch.uint8 for n in experts)
    def same_experts(engine) -> bool:
        for theirs, ours in zip(engine.model.model.layers[1:], trainer.model.model.layers[1:], strict=True):
            for name in ("w1", "w2", "w3"):
                value, master = theirs.mlp.experts.dense_weight(name), getattr(ours.mlp.experts, name).detach()
                assert value.dtype == torch.bfloat16
                if not torch.equal(value.float(), mx.fake_mxfp4(master)):
                    return False
        return True

    # version 0: the same seeded init, its experts quantised from fp32 as the learner's masters are
    with EmbeddedEngine.from_preset(cfg.model.preset, overrides=cfg.model.k3_overrides, dtype="bfloat16",
                                    seed=cfg.model.seed, max_num_seqs=2) as engine:
        assert same_experts(engine)
    with EmbeddedEngine.from_preset(cfg.model.preset, overrides=cfg.model.k3_overrides, dtype="bfloat16", seed=1,
                                    max_num_seqs=2) as engine:
        names = dict(engine.model.named_parameters())
        assert not [n for n in names if ".experts." in n]  # no dense expert weights in the engine
        held = engine.model.model.layers[1].mlp.experts
        assert held.w1_packed.dtype == torch.uint8 and held.w1_packed.shape == (8, 64, 32)
        assert not same_experts(engine)
        engine.update_weights(update)
        assert same_experts(engine)
        prefix = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
        assert torch.equal(held.w1_packed[3], sent[f"{prefix}.weight_packed"])  # the bytes, copied as they came
        assert torch.equal(held.w1_scale[3], sent[f"{prefix}.weight_scale"])
        # a partial update: expert 3 of layer 1's w1 only, its scales one up (every value doubled)
        before = held.dense_weight("w1").clone()
        bump = {f"{prefix}.weight_packed": sent[f"{prefix}.weight_packed"],
                f"{prefix}.weight_scale": sent[f"{prefix}.weight_scale"] + 1}
        engine.update_weights(WeightUpdate.from_state_dict(2, bump, full=False))
        after = held.dense_weight("w1")
        assert torch.equal(after[3], 2 * before[3]) and torch.equal(after[:3], before[:3])
        assert torch.equal(after[4:], before[4:])
        with pytest.raises(ValueError, match=r"lacks 1 MXFP4 pieces of model.layers.1.mlp.experts.w1"):
            only_codes = {f"{prefix}.weight_packed": bump[f"{prefix}.weight_packed"]}
            engine.update_weights(WeightUpdate.from_state_dict(3, only_codes, full=False))
        # dense fp32 experts (a sync with experts="dense") are stored quantised: the same values again
        engine.update_weights(trainer.export_weights(3, experts="dense"))
        assert same_experts(engine)
    dense = Trainer.from_job(JobConfig.load(None, ["learner.steps=1"])).export_weights(1).state_dict()
    assert all(n.endswith(".weight") for n in dense if ".experts." in n)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_learner_trains_its_master_experts_through_the_quantisation(bf16):
    """One RL step under mxfp4 (fp32, and bf16 autocast): finite; the fp32 master expert weights move (the
    straight-through gradient reaches them) by much less than an MXFP4 step, so few of their quantised values
    change yet (measured, fp32: masters by at most 4.8e-5, 0.1% of the values of layer 1's w1); the next sync
    carries the quantised values of the new masters."""
    cfg = JobConfig.load(None, ["model.expert_precision=mxfp4", "learner.steps=1", "learner.micro_batch_tokens=256",
                                f"learner.bf16={bf16}"])
    trainer = Trainer.from_job(cfg)
    experts = trainer.model.model.layers[1].mlp.experts
    before = experts.w1.detach().clone()
    g = torch.Generator().manual_seed(0)
    trajs = [Trajectory(env_id="test/Synthetic-v0", group_id="g", prompt_ids=torch.randint(0, 256, (6,), generator=g).tolist(),
                        completion_ids=torch.randint(0, 256, (10,), generator=g).tolist(), logprobs=[-5.5] * 10,
                        loss_mask=[1] * 10, versions=[0] * 10, reward=float(i % 2)) for i in range(4)]
    m = trainer.train_step(trajs)
    assert m["grad_norm"] > 0 and all(v == v for v in m.values())  # no NaN
    assert experts.w1.dtype == torch.float32 and (experts.w1.detach() != before).any()
    changed = (mx.fake_mxfp4(experts.w1.detach()) != mx.fake_mxfp4(before)).float().mean()
    assert changed < 0.05
    sent = trainer.export_weights(2).state_dict()
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    got = mxfp4.dequantize(sent[f"{name}.weight_packed"], sent[f"{name}.weight_scale"], torch.float32)
    assert torch.equal(got, mx.fake_mxfp4(experts.w1.detach())[0])
