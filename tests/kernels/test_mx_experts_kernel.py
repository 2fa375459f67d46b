"""The MXFP4-expert kernels (kernels/moe/triton_mx_experts.py): under the interpreter (in a fresh process:
mx_experts_interpret_cases.py), their build for sm_90 (mx_experts_sm90_check.py), the grouped path's route
layout, the input checks, and on a GPU at k3-small sizes against the engine's reference path, eagerly and
replayed from a CUDA graph."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BG, BU = 4.0, 25.0


@has_triton
@pytest.mark.slow
@pytest.mark.interpreter_cases("mx_experts_interpret_cases.py")
def test_mx_experts_kernels_under_the_interpreter():
    run_interpreted("mx_experts_interpret_cases.py")


@pytest.mark.slow  # seconds: make test runs it, make test-fast leaves it out
@has_triton
def test_mx_experts_kernels_compile_for_sm90():
    """Every kernel builds for Hopper with triton's own compiler at K3's sizes in bf16 (mx_experts_sm90_check.py)."""
    shared = run_sm90_check("mx_experts_sm90_check.py")
    assert sorted(shared) == sorted(["mxfp8_quantize", "decode_gate_up", "decode_down", "grouped_gate_up",
                                     "grouped_down", "combine"])  # fmt: skip
    assert all(nbytes <= 232448 for nbytes in shared.values())  # the shared memory one block may use on sm_90


@has_triton
def test_grouped_layout_puts_each_experts_routes_in_whole_tiles():
    from k3rl.kernels.moe.triton_mx_experts import expert_order, group_routes

    idx = torch.tensor([[3, 0], [3, 3], [0, 2]])  # expert 1 gets no route, expert 3 three
    pos, row_token, tile_expert = group_routes(idx, num_experts=4, block_m=2)
    # groups of 2-row tiles: expert 0 rows 0-1, expert 2 rows 2-3 (one padding row), expert 3 rows 4-7
    assert pos.tolist() == [4, 0, 5, 6, 1, 2]  # route r = t k + j, in token order within its group
    assert row_token.tolist() == [0, 2, 2, -1, 0, 1, 1, -1, -1, -1]  # M = R + E (2 - 1) = 10 rows (static)
    assert tile_expert.tolist() == [0, 2, 3, 3, -1]
    assert expert_order(idx).tolist() == [[1, 0], [0, 1], [0, 1]]  # a token's routes by expert, ties by slot


def _held(E, F, L, dtype, device, backend="torch", seed=0):
    """RoutedExperts holding MXFP4 bytes (an engine under expert_precision mxfp4), quantised from fp32."""
    # lazy: the model package, only where a test builds experts
    from k3rl.model.moe import RoutedExperts

    cfg = SimpleNamespace(num_experts=E, moe_intermediate_size=F, routed_expert_hidden_size=L, activation_situ_beta=BG,
                          activation_situ_linear_beta=BU, kernel_backend=backend, expert_precision="mxfp4")  # fmt: skip
    m = RoutedExperts(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.w1.copy_(torch.randn(E, F, L, generator=gen) * 2 / L**0.5)
        m.w3.copy_(torch.randn(E, F, L, generator=gen) * 20 / L**0.5)
        m.w2.copy_(torch.randn(E, L, F, generator=gen) / F**0.5)
    m.hold_mxfp4_(read_dtype=dtype)
    return m.to(device)


def _args(m):
    return [getattr(m, f"{n}_{part}") for n in m.NAMES for part in ("packed", "scale")]


@has_triton
def test_mx_experts_refuses_wrong_inputs():
    from k3rl.kernels.moe.triton_mx_experts import mx_experts_triton, mxfp8_quantize_triton

    m = _held(4, 32, 64, torch.float32, "cpu")
    z, idx, p = torch.randn(2, 64), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3)
    w = dict(zip(("w1p", "w1s", "w3p", "w3s", "w2p", "w2s"), _args(m), strict=True))
    bad = [
        (dict(z=z[0]), r"z must be \[N, l\]"),
        (dict(z=z.double()), "bf16, fp16 or fp32"),
        (dict(idx=idx.float()), r"idx must be integer \[N=2, k\]"),
        (dict(p=p[:, :2]), r"p must be floating \[N, k\] = \(2, 3\)"),
        (dict(w2p=w["w2p"].view(torch.int8)), "uint8"),
        (dict(z=torch.randn(2, 48), w1p=w["w1p"][..., :24], w3p=w["w3p"][..., :24]), "multiples of 32"),
        (dict(w1s=w["w1s"][:, :16]), r"w1_scale must be \[4, 32, 2\]"),
        (dict(w2p=w["w2p"].transpose(1, 2).contiguous().transpose(1, 2)), "w2_packed must be contiguous"),
    ]
    for change, msg in bad:
        a = {"z": z, "idx": idx, "p": p, **w, **change}
        with pytest.raises(ValueError, match=msg):
            mx_experts_triton(a["z"], a["idx"], a["p"], a["w1p"], a["w1s"], a["w3p"], a["w3s"], a["w2p"], a["w2s"],
                              BG, BU)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize_triton(torch.randn(2, 40))


@pytest.fixture
def full_precision_bmm(monkeypatch):
    """The reference's matmuls as the kernels sum: fp32 products in fp32 (no TF32, no reduced-precision bf16 sums)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)


def _inputs(N, k, E, L, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen).bfloat16().cuda()
    idx = torch.randint(0, E, (N, k), generator=gen).cuda()
    p = torch.softmax(torch.randn(N, k, generator=gen), -1).cuda()
    return z, idx, p


def _nearly_equal(y, ref):
    """bf16: equal but where a GEMM's fp32 sum, summed in another order than cuBLAS's, rounds the other way."""
    differ = (y != ref).float().mean().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-6, atol=2**-7 * ref.float().abs().max().item())
    assert differ < 0.01, differ
    return differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [1, 5, 300])
def test_mx_experts_kernels_on_the_gpu_k3_small(N, full_precision_bmm):
    """k3-small's routed experts (l = 384, f = 256, E = 32, k = 4) held as MXFP4 in bf16: batch 1 takes the
    decode kernels, 5 and 300 the grouped path; against RoutedExperts' reference path on the same bytes."""
    from k3rl.kernels.moe.triton_mx_experts import mx_decode_experts_triton, mx_experts_triton

    m = _held(32, 256, 384, torch.bfloat16, "cuda")
    z, idx, p = _inputs(N, 4, 32, 384, seed=N)
    idx[0, :2] = 7  # a repeated expert
    ref = m(z, idx, p)  # backend "torch": the reference path
    for y in (mx_experts_triton(z, idx, p, *_args(m), BG, BU), mx_decode_experts_triton(z, idx, p, *_args(m), BG, BU)):
        print(f"N={N}: {_nearly_equal(y, ref):.2%} of values differ from the reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [2, 64])
def test_mx_experts_kernels_in_a_cuda_graph(N, full_precision_bmm):
    """Captured once (decode kernels at batch 2, the grouped path at 64), replayed after z, idx and p change in
    place: the replay reads the new values (no host sync in either path)."""
    from k3rl.kernels.moe.triton_mx_experts import mx_experts_triton

    m = _held(32, 256, 384, torch.bfloat16, "cuda")
    z, idx, p = _inputs(N, 4, 32, 384, seed=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile outside the capture
        mx_experts_triton(z, idx, p, *_args(m), BG, BU)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mx_experts_triton(z, idx, p, *_args(m), BG, BU)
    for seed in (10, 11):
        z2, idx2, p2 = _inputs(N, 4, 32, 384, seed=seed)
        z.copy_(z2), idx.copy_(idx2), p.copy_(p2)
        graph.replay()
        torch.cuda.synchronize()
        _nearly_equal(y, m(z, idx, p))
