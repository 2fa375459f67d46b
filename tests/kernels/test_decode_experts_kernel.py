"""The fused decode-experts kernels (kernels/moe/triton_decode_experts.py): under the interpreter (in a
fresh process: decode_experts_interpret_cases.py), the reference against the learner's loop,
the input checks, and on a GPU at k3-small sizes, eagerly and replayed from a CUDA graph."""

import importlib.util

import pytest
import torch
from interpreter_run import run_interpreted

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BG, BU = 4.0, 25.0


def inputs(N, k, E, L, F, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)
    z = r(N, L).to(dtype)
    w1 = (r(E, F, L) * 2 / L**0.5).to(dtype)
    w3 = (r(E, F, L) * 20 / L**0.5).to(dtype)
    w2 = (r(E, L, F) / F**0.5).to(dtype)
    idx = torch.randint(0, E, (N, k), generator=gen, device=device)
    p = torch.softmax(r(N, k), -1)
    return z, idx, p, w1, w3, w2


@has_triton
@pytest.mark.slow
@pytest.mark.interpreter_cases("decode_experts_interpret_cases.py")
def test_decode_experts_kernel_under_the_interpreter():
    run_interpreted("decode_experts_interpret_cases.py")


@has_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_learners_routed_experts(dtype):
    """decode_experts_reference against the learner's latent_experts_loop (its own order of work): equal
    in fp32 to rounding, within bf16's roundings in bf16; experts repeated within rows and across tokens.
    The bf16 roundings are its own: the same chain in fp32, rounded once at the end, is another result."""
    from k3rl.kernels.moe import latent_experts_loop
    from k3rl.kernels.moe.triton_decode_experts import decode_experts_reference

    z, idx, p, w1, w3, w2 = inputs(3, 4, 6, 40, 24, dtype)
    idx[0] = torch.tensor([5, 5, 1, 5])
    idx[2, 0] = 1
    ref = decode_experts_reference(z, idx, p, w1, w3, w2, BG, BU)
    loop = latent_experts_loop(z, idx, p, w1, w3, w2, BG, BU)
    assert ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ref.float(), loop.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        once = decode_experts_reference(z.float(), idx, p, w1.float(), w3.float(), w2.float(), BG, BU).to(dtype)
        assert not torch.equal(ref, once)


@has_triton
def test_decode_experts_refuses_wrong_inputs():
    from k3rl.kernels.moe.triton_decode_experts import decode_experts_triton

    z, idx, p, w1, w3, w2 = inputs(2, 3, 4, 16, 8, torch.float32)
    bad = [
        (dict(z=z[0]), r"z must be \[N, l\]"),
        (dict(idx=idx.float()), r"idx must be integer \[N=2, k\]"),
        (dict(idx=idx[:1]), r"idx must be integer \[N=2, k\]"),
        (dict(p=p[:, :2]), r"p must be floating \[N, k\] = \(2, 3\)"),
        (dict(w3=w3[:, :4]), r"w1 and w3 must be \[E, f, l=16\]"),
        (dict(w2=w2.transpose(1, 2)), r"w2 must be \[E=4, l=16, f=8\]"),
        (dict(z=z.double(), w1=w1.double(), w3=w3.double(), w2=w2.double()), "z must be bf16, fp16 or fp32"),
        (dict(w2=w2.bfloat16()), "must share one dtype"),
        (dict(w1=w1.transpose(1, 2).contiguous().transpose(1, 2)), "must be contiguous"),
    ]
    args = dict(z=z, idx=idx, p=p, w1=w1, w3=w3, w2=w2)
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            decode_experts_triton(**{**args, **change}, beta_gate=BG, beta_up=BU)
    with pytest.raises(ValueError, match="must be positive"):
        decode_experts_triton(**args, beta_gate=0.0, beta_up=BU)


@pytest.fixture
def full_precision_bmm(monkeypatch):
    """The reference's bmm as the kernels sum: fp32 products in fp32 (no TF32, no reduced-precision bf16 reduction)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)


def _bf16_close(y, ref):
    err = (y.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(
        y.float(), ref.float(), rtol=2**-7, atol=2**-8 * ref.float().abs().max().item()
    )
    assert (y != ref).float().mean().item() < 0.1
    return err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_experts_kernel_on_the_gpu_k3_small(N, dtype, full_precision_bmm):
    """k3-small's routed experts (l = 384, f = 256, E = 32, k = 4), against the reference."""
    from k3rl.kernels.moe.triton_decode_experts import decode_experts_reference, decode_experts_triton

    args = inputs(N, 4, 32, 384, 256, dtype, device="cuda", seed=N)
    args[1][0, :2] = 7  # a repeated expert
    y = decode_experts_triton(*args, BG, BU)
    ref = decode_experts_reference(*args, BG, BU)
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        err = (y - ref).abs().max().item()
    else:
        err = _bf16_close(y, ref)
    print(f"N={N} {dtype}: max |y - ref| = {err:.3g} (max |ref| = {ref.float().abs().max().item():.3g})")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_experts_kernel_in_a_cuda_graph(full_precision_bmm):
    """Captured once, replayed after z and idx (and p) change in place: the replay reads the new values."""
    from k3rl.kernels.moe.triton_decode_experts import decode_experts_reference, decode_experts_triton

    z, idx, p, w1, w3, w2 = inputs(4, 4, 32, 384, 256, torch.bfloat16, device="cuda", seed=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile outside the capture
        decode_experts_triton(z, idx, p, w1, w3, w2, BG, BU)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = decode_experts_triton(z, idx, p, w1, w3, w2, BG, BU)
    before = decode_experts_reference(z, idx, p, w1, w3, w2, BG, BU)
    for seed in (10, 11):
        z2, idx2, p2, *_ = inputs(4, 4, 32, 384, 256, torch.bfloat16, device="cuda", seed=seed)
        z.copy_(z2), idx.copy_(idx2), p.copy_(p2)
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_experts_reference(z, idx, p, w1, w3, w2, BG, BU)
        _bf16_close(y, ref)
        assert not torch.equal(ref, before) and (y.float() - before.float()).abs().max().item() > 0.1
        before = ref
