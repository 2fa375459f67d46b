"""Context parallelism on CPU: gloo process groups of 2 and 4 ranks equal one process.

KCP (``kcp_chunk_kda``) and context-parallel Gated MLA (``GatedMLA`` under ``ContextParallel``) on one packed sequence
of ragged documents: documents cross rank boundaries, one spans three ranks, one starts exactly
at a rank boundary. Forward outputs, final states and the gradients of every input (q, k, v, the
raw gate, beta, the initial states, A_log, dt_bias; the MLA weights and input) must equal
``chunk_kda`` / ``GatedMLA`` on the whole sequence in one process, to fp32 rounding, with the
contiguous and the zigzag layouts. The whole k3-tiny model (KDA, Gated MLA, AttnRes, LatentMoE)
under ``model(ids_shard, cu_seqlens=whole, context_parallel=cp)``: each rank's logits are its
shard of one process's, the ranks' losses add up to one process's loss, and every parameter's
gradient summed over the ranks equals one process's; contiguous, and zigzag under activation
checkpointing (whose recompute runs the collectives again). One spawn per world size runs every
case.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from learner_helpers import gloo_group

from k3rl.cluster import free_port
from k3rl.kernels.kda import chunk_kda
from k3rl.learner.context_parallel import context_layout, kcp_chunk_kda, local_documents, shard
from k3rl.learner.context_parallel_layers import ContextParallel, cp_short_conv
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.kda import short_conv
from k3rl.model.mla import GatedMLA

T, H, K, V, CHUNK = 200, 2, 16, 16, 16
# ranks of 4 hold [0,50) [50,100) [100,150) [150,200): document [30,140) spans three ranks,
# [150,181) starts on a boundary, [140,150) sits inside rank 2, [181,200) ends the sequence
CU = torch.tensor([0, 30, 140, 150, 181, 200])
# for the short conv (4 taps): [49, 51) is shorter than the 3 rows of left context and crosses the
# boundary at 50, [51, 102) crosses the one at 100
CU_CONV = torch.tensor([0, 49, 51, 102, 200])
LAYOUTS = [False, True]  # contiguous, zigzag
KDA_OPTS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, chunk_size=CHUNK,
                backend="torch")  # fmt: skip


def _kda_inputs() -> dict[str, torch.Tensor]:
    """Slow decay (g about -5 sigmoid(-6) = -0.012 per token) and small beta: a state carries
    over a whole rank's 50 tokens, so a missing transition M would show."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    n = CU.numel() - 1
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K),
                beta=0.5 * torch.rand(1, T, H, generator=gen), h0=0.1 * r(n, H, K, V), A_log=0.3 * r(H),
                dt_bias=0.3 * r(H * K) - 6, w_o=r(1, T, H, V), w_s=r(n, H, K, V))  # fmt: skip


def _kda_leaves(inp, segments=None):
    """The differentiable inputs (this rank's shards of the per-token ones) as fresh leaves."""
    per_token = ("q", "k", "v", "g", "beta")
    out = {}
    for name in (*per_token, "h0", "A_log", "dt_bias"):
        x = inp[name]
        if segments is not None and name in per_token:
            x = shard(x, segments)
        out[name] = x.clone().requires_grad_(True)
    return out


def _kda_call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
              A_log=x["A_log"], dt_bias=x["dt_bias"], **KDA_OPTS, **kw)  # fmt: skip


def _mla_layer() -> GatedMLA:
    torch.manual_seed(1)
    cfg = K3Config.preset("k3-tiny")
    cfg.kernel_backend = "torch"
    return GatedMLA(cfg, layer_idx=0)


def _mla_inputs():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(1, T, 128, generator=gen), torch.randn(1, T, 128, generator=gen)


def _conv_inputs():
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randn(1, T, 8, generator=gen),
        torch.randn(8, 1, 4, generator=gen),
        torch.randn(1, T, 8, generator=gen),
    )


def _k3_tiny() -> K3ForCausalLM:
    torch.manual_seed(4)
    config = K3Config.preset("k3-tiny")
    config.kernel_backend = "torch"
    return K3ForCausalLM(config)


def _model_inputs():
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(5))
    return ids, torch.roll(ids, -1, dims=1)


def _model_run(model, ids, targets, **kw):
    """(logits, summed cross-entropy, every parameter's gradient) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, cu_seqlens=CU, **kw)
    loss = F.cross_entropy(logits[0].float(), targets[0], reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port, timeout=120):
        res = {}
        inp = _kda_inputs()
        for zigzag in LAYOUTS:
            segments = context_layout(T, world, zigzag)[rank]
            x = _kda_leaves(inp, segments)
            o, final = _kda_call(kcp_chunk_kda, x, cu_seqlens=CU, zigzag=zigzag)
            docs = local_documents(CU, segments)
            ends = [i for i, d in enumerate(docs.doc) if any(s < int(CU[d + 1]) <= e for s, e in segments)]
            ended = {docs.doc[i]: final[i] for i in ends}  # documents whose last token is on this rank
            loss = (o * shard(inp["w_o"], segments)).sum() + sum(
                (s * inp["w_s"][d]).sum() for d, s in ended.items()
            )
            loss.backward()
            res[("kda", zigzag)] = dict(o=o.detach(), final={d: s.detach() for d, s in ended.items()},
                                        grads={n: t.grad for n, t in x.items()})  # fmt: skip

            layer = _mla_layer()
            x_mla, w_mla = _mla_inputs()
            x_local = shard(x_mla, segments).requires_grad_(True)
            y = layer(x_local, CU, context_parallel=ContextParallel(zigzag=zigzag))
            (y * shard(w_mla, segments)).sum().backward()
            res[("mla", zigzag)] = dict(y=y.detach(), x_grad=x_local.grad,
                                        grads={n: p.grad for n, p in layer.named_parameters()})  # fmt: skip

            x_conv, w_conv, w_y = _conv_inputs()
            x_local, w_conv = shard(x_conv, segments).requires_grad_(True), w_conv.requires_grad_(True)
            y = cp_short_conv(x_local, w_conv, CU_CONV, zigzag=zigzag)
            (y * shard(w_y, segments)).sum().backward()
            res[("conv", zigzag)] = dict(y=y.detach(), x_grad=x_local.grad, w_grad=w_conv.grad)

            cp, model = ContextParallel(zigzag=zigzag), _k3_tiny()
            model.gradient_checkpointing = zigzag
            ids, targets = _model_inputs()
            res[("model", zigzag)] = _model_run(model, cp.shard(ids), cp.shard(targets), context_parallel=cp)
        segments = context_layout(T, world)[rank]
        x = {n: shard(inp[n], segments) for n in ("q", "k", "v", "g", "beta")}
        bad_calls = {
            "bad_shard": lambda: kcp_chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], CU),
            "bad_h0": lambda: kcp_chunk_kda(*x.values(), CU, initial_state=inp["h0"][:2]),
            "bad_cu": lambda: kcp_chunk_kda(*x.values(), CU.flip(0)),
        }
        for name, call in bad_calls.items():  # refused before any collective, on every rank
            try:
                call()
                res[name] = None
            except ValueError as e:
                res[name] = str(e)
        torch.save(res, os.path.join(out_dir, f"cp{rank}.pt"))


@pytest.fixture(scope="module", params=[pytest.param(w, id=f"world{w}", marks=pytest.mark.slow) for w in (2, 4)])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"cp{world}")
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return world, [torch.load(out / f"cp{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def one_process_kda():
    torch.set_num_threads(1)
    inp = _kda_inputs()
    x = _kda_leaves(inp)
    o, final = _kda_call(chunk_kda, x, cu_seqlens=CU)
    ((o * inp["w_o"]).sum() + (final * inp["w_s"]).sum()).backward()
    return o.detach(), final.detach(), {n: t.grad for n, t in x.items()}


@pytest.fixture(scope="module")
def one_process_mla():
    layer = _mla_layer()
    x, w = _mla_inputs()
    x.requires_grad_(True)
    y = layer(x, cu_seqlens=CU)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _close(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 2e-5, floor: float = 1.0) -> None:
    err = (got - want).abs().max().item()
    assert err <= rel * max(floor, want.abs().max().item()), (name, err)


@pytest.mark.parametrize("zigzag", LAYOUTS, ids=["contiguous", "zigzag"])
def test_kcp_forward_and_backward_equal_one_process(ranks, one_process_kda, zigzag):
    world, res = ranks
    o_ref, final_ref, grads_ref = one_process_kda
    layout = context_layout(T, world, zigzag)
    ended = {}
    for rank in range(world):
        got = res[rank][("kda", zigzag)]
        _close(got["o"], shard(o_ref, layout[rank]), f"o rank {rank}")
        ended.update(got["final"])
        for name in ("q", "k", "v", "g", "beta"):
            _close(got["grads"][name], shard(grads_ref[name], layout[rank]), f"d{name} rank {rank}")
    assert sorted(ended) == list(range(CU.numel() - 1))  # every document ends on exactly one rank
    for d, state in ended.items():
        _close(state, final_ref[d], f"final state of document {d}")
    for name in ("h0", "A_log", "dt_bias"):  # read by several ranks: their gradients add up
        per_rank = [res[r][("kda", zigzag)]["grads"][name] for r in range(world)]
        total = sum(g for g in per_rank if g is not None)  # None: no document starts on that rank
        _close(total, grads_ref[name], f"d{name}")


def test_kcp_chain_matters(ranks, one_process_kda):
    """Without the states of earlier ranks the outputs after a rank boundary would be wrong."""
    world, res = ranks
    o_ref = one_process_kda[0]
    inp = _kda_inputs()
    s, e = context_layout(T, world)[1][0]  # rank 1 continues document [30, 140)
    alone, _ = chunk_kda(inp["q"][:, s:e], inp["k"][:, s:e], inp["v"][:, s:e], inp["g"][:, s:e],
                         inp["beta"][:, s:e], A_log=inp["A_log"], dt_bias=inp["dt_bias"], **KDA_OPTS)  # fmt: skip
    assert (alone - o_ref[:, s:e]).abs().max() > 1e-2
    _close(res[1][("kda", False)]["o"], o_ref[:, s:e], "o rank 1")


@pytest.mark.parametrize("zigzag", LAYOUTS, ids=["contiguous", "zigzag"])
def test_cp_mla_layer_forward_and_backward_equal_one_process(ranks, one_process_mla, zigzag):
    world, res = ranks
    y_ref, x_grad_ref, grads_ref = one_process_mla
    layout = context_layout(T, world, zigzag)
    for rank in range(world):
        got = res[rank][("mla", zigzag)]
        _close(got["y"], shard(y_ref, layout[rank]), f"y rank {rank}")
        _close(got["x_grad"], shard(x_grad_ref, layout[rank]), f"dx rank {rank}")
    for name, want in grads_ref.items():  # replicated weights: the ranks' gradients add up
        _close(sum(res[r][("mla", zigzag)]["grads"][name] for r in range(world)), want, f"d{name}")


@pytest.mark.parametrize("zigzag", LAYOUTS, ids=["contiguous", "zigzag-checkpointed"])
def test_cp_model_forward_and_backward_equal_one_process(ranks, zigzag):
    world, res = ranks
    torch.set_num_threads(1)
    logits, loss, grads = _model_run(_k3_tiny(), *_model_inputs())
    layout = context_layout(T, world, zigzag)
    got = [res[r][("model", zigzag)] for r in range(world)]
    for rank in range(world):
        _close(got[rank][0], shard(logits, layout[rank]), f"logits rank {rank}", floor=1e-3)
    _close(sum(g[1] for g in got), loss, "loss", floor=1e-3)
    assert all(g[2].keys() == grads.keys() for g in got)
    assert any(".self_attn.A_log" in n for n in grads) and any(".mlp.experts.w1" in n for n in grads)
    for name, want in grads.items():  # replicated weights: each rank's gradient covers its own tokens
        _close(sum(g[2][name] for g in got), want, f"d{name}", rel=5e-5, floor=1e-3)


def test_cp_model_refuses_what_it_cannot_split():
    model, cp = _k3_tiny(), ContextParallel()
    ids, _ = _model_inputs()
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        model(ids, context_parallel=cp)
    with pytest.raises(ValueError, match="vision tower does not run context-parallel"):
        model(ids, cu_seqlens=CU, images=[], context_parallel=cp)
    with pytest.raises(ValueError, match="no cache"):
        model(ids, cu_seqlens=CU, cache=model.new_cache(1), context_parallel=cp)


@pytest.mark.parametrize("zigzag", LAYOUTS, ids=["contiguous", "zigzag"])
def test_cp_short_conv_equals_one_process(ranks, zigzag):
    world, res = ranks
    x, w, w_y = _conv_inputs()
    x.requires_grad_(True), w.requires_grad_(True)
    y, _ = short_conv(x, w, None, CU_CONV)
    (y * w_y).sum().backward()
    layout = context_layout(T, world, zigzag)
    for rank in range(world):
        got = res[rank][("conv", zigzag)]
        _close(got["y"], shard(y.detach(), layout[rank]), f"y rank {rank}")
        _close(got["x_grad"], shard(x.grad, layout[rank]), f"dx rank {rank}")
    _close(sum(res[r][("conv", zigzag)]["w_grad"] for r in range(world)), w.grad, "dweight")


def test_bad_input_is_refused(ranks):
    world, res = ranks
    assert "rank 0 holds 200 tokens" in res[0]["bad_shard"] and "shard(x" in res[0]["bad_shard"]
    assert "initial_state must be [N=5 documents" in res[0]["bad_h0"]
    assert "cu_seqlens must start at 0" in res[0]["bad_cu"]


def test_layouts():
    assert context_layout(10, 3) == [[(0, 3)], [(3, 6)], [(6, 10)]]
    assert context_layout(8, 2, zigzag=True) == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    with pytest.raises(ValueError, match="3 tokens cannot be split into 4"):
        context_layout(3, 2, zigzag=True)
    docs = local_documents(CU, [(50, 100), (100, 150)])
    assert docs.cu_seqlens.tolist() == [0, 50, 90, 100]
    assert (
        docs.doc == [1, 1, 2]
        and docs.carries_in == [True, True, False]
        and docs.starts_doc == [False, False, True]
    )


def test_zigzag_balances_causal_attention():
    """(query, key) pairs each rank's causal attention scores, for one 1,024-token document."""

    def pairs(segments):
        return sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in segments)  # sum of (p + 1) over p in [s, e)

    contiguous = [pairs(segs) for segs in context_layout(1024, 4)]
    zigzag = [pairs(segs) for segs in context_layout(1024, 4, zigzag=True)]
    assert max(contiguous) / min(contiguous) > 6.9  # about 1 : 3 : 5 : 7
    assert max(zigzag) == min(zigzag) == sum(contiguous) // 4
