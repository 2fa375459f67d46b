"""Per-Head Muon (docs/model.md §8, §10.14) and the AdamW side of the optimizer."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch import nn

import k3rl.learner.optim as optim
from k3rl.learner.optim import PerHeadMuon, QKClip, newton_schulz, param_groups
from k3rl.model import K3Config, K3ForCausalLM

torch.set_num_threads(1)
ns_kernel = importlib.import_module("k3rl.kernels.newton_schulz")  # the package re-exports the function under the same name


def test_newton_schulz_is_the_kernel_op():
    assert newton_schulz is ns_kernel.newton_schulz


@pytest.mark.parametrize("shape", [(4, 64, 128), (3, 128, 64), (2, 3, 48, 96)])
def test_newton_schulz_singular_values_in_a_band_around_one(shape):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(*shape, generator=g)
    s = torch.linalg.svdvals(newton_schulz(G, steps=5))
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())


def test_newton_schulz_equalises_singular_values_spanning_two_orders():
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(64, 32, generator=g))
    V, _ = torch.linalg.qr(torch.randn(128, 32, generator=g))
    sigma = torch.logspace(0, -2, 32)
    G = U @ torch.diag(sigma) @ V.T  # [64, 128], condition number 100
    s = torch.linalg.svdvals(newton_schulz(G, steps=5))[:32]
    assert s.min() > 0.6 and s.max() < 1.2, (s.min(), s.max())
    # ... and keeps the singular vectors: O = U diag(p(sigma)) V^T
    ortho = newton_schulz(G, steps=5)
    assert torch.allclose(U @ (U.T @ ortho @ V) @ V.T, ortho, atol=1e-4)


class HeadProj(nn.Module):
    """A KDA-like q_proj [H*D, d] plus a stacked expert weight [E, f, l]."""

    def __init__(self, H=4, D=32, d=256, E=3, f=16, latent=24):
        super().__init__()
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.zeros(E, f, latent))


def _one_step(module, grads, block_rows, lr=0.1, wd=0.0):
    groups, _ = param_groups(module, lr=lr, weight_decay=wd, head_rows={"q_proj": block_rows} if block_rows else {})
    opt = PerHeadMuon(groups, lr=lr, weight_decay=wd)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return {n: (p.detach() - before[n]) for n, p in module.named_parameters()}


def _grads(m, head_scales, seed=0, disjoint=True):
    H, D, d = 4, 32, 256
    g = torch.Generator().manual_seed(seed)
    G = torch.zeros(H * D, d)
    for h in range(H):  # heads act on disjoint input columns, so whole-matrix NS could treat them alike
        cols = slice(h * 64, (h + 1) * 64) if disjoint else slice(0, d)
        G[h * D : (h + 1) * D, cols] = torch.randn(D, G[:, cols].shape[1], generator=g) * head_scales[h]
    return {"q_proj.weight": G, "experts.w1": torch.randn(3, 16, 24, generator=g) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]}


def test_per_head_update_is_ns_of_each_head_block_with_the_block_scale():
    m = HeadProj()
    grads = _grads(m, [1.0, 1.0, 1.0, 0.01])
    lr = 0.1
    upd = _one_step(m, grads, block_rows=32, lr=lr)
    mu = 0.95
    # first step: M = G, Nesterov input U = G + mu M = (1 + mu) G
    U = (1 + mu) * grads["q_proj.weight"]
    expect = torch.cat([newton_schulz(U[h * 32 : (h + 1) * 32]) for h in range(4)])
    assert torch.allclose(upd["q_proj.weight"], -lr * 0.2 * math.sqrt(256) * expect, atol=1e-6)
    # per expert: each [16, 24] block separately, scale 0.2 sqrt(24)
    Ue = (1 + mu) * grads["experts.w1"]
    expect_e = torch.stack([newton_schulz(Ue[e]) for e in range(3)])
    assert torch.allclose(upd["experts.w1"], -lr * 0.2 * math.sqrt(24) * expect_e, atol=1e-6)


def _block_norms(update):
    return update.view(4, 32, 256).norm(dim=(1, 2))


def test_per_head_differs_from_whole_matrix_where_head_scales_differ():
    # equal head scales: both forms give every head the same update size
    equal = _grads(HeadProj(), [1.0, 1.0, 1.0, 1.0])
    for rows in (32, None):
        n = _block_norms(_one_step(HeadProj(), equal, rows)["q_proj.weight"])
        assert n.max() / n.min() < 1.1, (rows, n)
    # one head 100x smaller: whole-matrix NS under-updates exactly that head; per-head does not
    skewed = _grads(HeadProj(), [1.0, 1.0, 1.0, 0.01])
    whole = _block_norms(_one_step(HeadProj(), skewed, None)["q_proj.weight"])
    per_head = _block_norms(_one_step(HeadProj(), skewed, 32)["q_proj.weight"])
    assert per_head.max() / per_head.min() < 1.1, per_head  # §10.14: nearly equal Frobenius norms
    assert whole[3] < 0.7 * whole[:3].min(), whole  # the small head is under-normalised
    assert whole[:3].max() / whole[:3].min() < 1.1, whole  # the other heads are unaffected


def test_per_head_norms_equal_when_scales_differ_100x_with_shared_inputs():
    grads = _grads(HeadProj(), [1.0, 100.0, 0.01, 3.0], disjoint=False)
    per_head = _block_norms(_one_step(HeadProj(), grads, 32)["q_proj.weight"])
    whole = _block_norms(_one_step(HeadProj(), grads, None)["q_proj.weight"])
    assert per_head.max() / per_head.min() < 1.1, per_head
    assert whole.max() / whole.min() > 3, whole


def test_blocks_of_one_shape_are_orthogonalised_in_one_batched_call(monkeypatch):
    calls = []

    def counting(G, steps=5, **kw):
        calls.append(tuple(G.shape))
        return ns_kernel.newton_schulz(G, steps=steps, **kw)

    monkeypatch.setattr(optim, "newton_schulz", counting)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    groups, _ = param_groups(model)
    opt = PerHeadMuon(groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    shapes = [s[1:] for s in calls]
    assert len(shapes) == len(set(shapes)), "one NS call per block shape"
    # KDA q/k/v of the 6 KDA layers: 6 * 3 * 2 heads of [32, 128] stacked in one call
    assert any(s[1:] == (32, 128) and s[0] >= 36 for s in calls)
    # 21 expert tensors [8, 64, 64] + the [64, 64] matrices of other kinds share one call
    assert any(s[1:] == (64, 64) and s[0] >= 21 * 8 for s in calls)


def test_param_groups_on_k3_tiny():
    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    groups, summary = param_groups(model)
    c = model.config
    D = c.linear_attn_config.head_dim
    by_name = {n: g for g in groups for n in g["names"]}
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["block_rows"] == D
    assert by_name["model.layers.0.self_attn.v_proj.weight"]["block_rows"] == D
    assert by_name["model.layers.3.self_attn.q_b_proj.weight"]["block_rows"] == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert by_name["model.layers.3.self_attn.kv_b_proj.weight"]["block_rows"] == c.qk_nope_head_dim + c.v_head_dim
    assert by_name["model.layers.3.self_attn.q_a_proj.weight"]["block_rows"] is None  # shared low-rank map: whole
    assert summary.group_of("model.layers.1.mlp.experts.w2") == "muon_per_expert"
    assert summary.group_of("model.layers.0.self_attn.o_proj.weight") == "muon_whole"
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_conv1d.weight",
                 "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias", "model.norm.weight",
                 "model.layers.0.self_attention_res_proj.weight", "model.output_attn_res_proj.weight"):
        assert by_name[name]["kind"] == "adamw", name
    assert summary.group_of("model.layers.1.mlp.gate.e_score_correction_bias") == "none"
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in by_name
    # every trainable parameter is in exactly one group
    grouped = [id(p) for g in groups for p in g["params"]]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {id(p) for p in model.parameters() if p.requires_grad}
    text = str(summary)
    assert "muon_per_head" in text and "adamw" in text and "set by Quantile Balancing" in text


def test_adamw_side_matches_torch_adamw():
    """Embedding and norm without weight decay, as torch.optim.AdamW with weight_decay=0 for them."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6))
    b = nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6))
    b.load_state_dict(a.state_dict())
    groups, _ = param_groups(a, lr=1e-2, weight_decay=0.1)
    assert all(g["kind"] == "adamw" and g["weight_decay"] == 0.0 for g in groups)
    ours = PerHeadMuon(groups, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(5):
        x = torch.randint(0, 10, (7,))
        for m, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_no_weight_decay_on_norms_embeddings_gates_and_biases():
    from k3rl.model import build_model

    model = build_model("k3-tiny", seed=0)
    groups, summary = param_groups(model, lr=1e-3, weight_decay=0.1)
    wd = {n: g["weight_decay"] for g in groups for n in g["names"]}
    for name, value in wd.items():
        exempt = any(part in name for part in ("embed", "norm", "A_log", "dt_bias", "bias")) or \
            dict(model.named_parameters())[name].dim() < 2
        assert value == (0.0 if exempt else 0.1), name
    assert any("A_log" in n for n in wd) and any("dt_bias" in n for n in wd) and any("embed" in n for n in wd)
    assert wd["lm_head.weight"] == 0.1 and any(v == 0.1 and "experts" in n for n, v in wd.items())
    assert "no weight decay" in str(summary)


def test_decoupled_weight_decay_with_zero_gradient():
    m = nn.Linear(8, 16, bias=False)
    w0 = m.weight.detach().clone()
    groups, _ = param_groups(m, lr=0.5, weight_decay=0.1)
    opt = PerHeadMuon(groups, lr=0.5, weight_decay=0.1)
    m.weight.grad = torch.zeros_like(m.weight)
    opt.step()
    assert torch.allclose(m.weight, w0 * (1 - 0.5 * 0.1))  # W (1 - lr wd), NS(0) = 0


def test_muon_trains_a_small_problem_at_least_as_well_as_adamw():
    """Classification by an MLP on rotated, ill-conditioned inputs; best of an LR grid each."""
    g = torch.Generator().manual_seed(0)
    d = 32
    R, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    X = torch.randn(512, d, generator=g) * torch.logspace(0, -2, d).sqrt() @ R.T
    y = (X @ torch.randn(d, 10, generator=g) * 10).argmax(-1)

    def train(kind, lr, steps=100):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(d, 128, bias=False), nn.ReLU(), nn.Linear(128, 128, bias=False), nn.ReLU(),
                            nn.Linear(128, 10, bias=False))
        groups, _ = param_groups(net, lr=lr, weight_decay=0.0)
        for grp in groups:
            grp["kind"] = kind
        opt = PerHeadMuon(groups, lr=lr, weight_decay=0.0)
        for i in range(steps):
            for grp in opt.param_groups:
                grp["lr"] = lr * (1 - i / steps)
            loss = nn.functional.cross_entropy(net(X), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return nn.functional.cross_entropy(net(X), y).item()

    lrs = (3e-2, 1e-1)
    muon = min(train("muon", lr) for lr in lrs)
    adamw = min(train("adamw", lr) for lr in lrs)
    assert muon <= adamw, (muon, adamw)


def test_bad_groups_raise_clear_errors():
    m = nn.Linear(8, 12, bias=True)
    with pytest.raises(ValueError, match="Muon needs matrices"):
        PerHeadMuon([{"params": [m.bias], "kind": "muon"}])
    with pytest.raises(ValueError, match="not a multiple of block_rows"):
        PerHeadMuon([{"params": [m.weight], "kind": "muon", "block_rows": 5}])
    with pytest.raises(ValueError, match="kind must be"):
        PerHeadMuon([{"params": [m.weight], "kind": "sgd"}])
    with pytest.raises(ValueError, match="not a multiple of the head block"):
        param_groups(nn.ModuleDict({"q_proj": nn.Linear(8, 12)}), head_rows={"q_proj": 5})


def test_qk_clip_caps_the_max_logit_of_hot_heads_only():
    g = torch.Generator().manual_seed(0)
    H, dn, dr, dv, qr, kvr = 3, 4, 2, 4, 8, 6
    q_b = torch.randn(H * (dn + dr), qr, generator=g) * 3
    kv_b = torch.randn(H * (dn + dv), kvr, generator=g) * 3
    cq = torch.randn(5, qr, generator=g)
    c = torch.randn(5, kvr, generator=g)
    kx = torch.randn(5, dr, generator=g)
    scale = (dn + dr) ** -0.5

    def max_logits(q_b, kv_b):
        q = (cq @ q_b.T).view(5, H, dn + dr)
        kv = (c @ kv_b.T).view(5, H, dn + dv)
        k = torch.cat([kv[..., :dn], kx[:, None].expand(5, H, dr)], -1)
        return (torch.einsum("thd,shd->hts", q, k) * scale).amax(dim=(1, 2))

    before = max_logits(q_b, kv_b)
    tau = float(before.sort().values[1])  # one head below, two above... the median
    gamma = QKClip(dn, dr, dv, tau=tau).apply(q_b, kv_b, before)
    after = max_logits(q_b, kv_b)
    hot = before > tau
    assert torch.allclose(after[hot], torch.full_like(after[hot], tau), rtol=1e-5)
    assert torch.allclose(after[~hot], before[~hot])
    assert torch.all(gamma[~hot] == 1)
