"""The Triton flash attention for Gated MLA's packed documents (kernels/attention/triton_flash.py): under the
interpreter (flash_attention_interpret_cases.py: values and gradients against the fp32 reference, with and
without a shared prefix, the dispatchers and the MLA layer), compiled for sm_90 (flash_sm90_check.py), and on
a GPU against the fp32 reference and the SDPA path."""

import importlib.util

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

from k3rl.kernels.attention import causal_attention, shared_prefix_attention

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.slow
@has_triton
@pytest.mark.interpreter_cases("flash_attention_interpret_cases.py")
def test_flash_attention_under_the_interpreter():
    run_interpreted("flash_attention_interpret_cases.py")


@pytest.mark.slow
@has_triton
def test_flash_attention_kernels_compile_for_sm90():
    """The compiler (not the interpreter) takes the four kernels at MLA's head dims in bf16 with the launch
    settings, each within a Hopper block's shared memory."""
    shared = run_sm90_check("flash_sm90_check.py", timeout=900)
    assert len(shared) == 4 and all(0 < n <= 232448 for n in shared.values()), shared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_on_the_gpu_matches_the_fp32_reference_and_sdpa():
    """bf16 at MLA's head dims (192 / 128), 8 heads, packed documents with a shared prefix: the kernel's
    output and gradients within bf16 tolerance of the fp32 reference, no further from it than SDPA's. Both
    bf16 paths run under the learner's bf16 autocast: without it the SDPA path widens its inputs to fp32
    (its error was then 6e-7, not a bf16 kernel's)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths, P, H = [700, 1, 333, 1024], 513, 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    q, k, kp = rand(1, T, H, 192), rand(1, T, H, 192), rand(1, P, H, 192)
    v, vp, do = rand(1, T, H, 128), rand(1, P, H, 128), rand(1, T, H, 128).float()

    def run(backend, kernel, cast):
        leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v, kp, vp)]
        with torch.autocast("cuda", torch.bfloat16, enabled=cast == torch.bfloat16):
            o = shared_prefix_attention(*leaves, 192**-0.5, cu, backend=backend, kernel=kernel)
        o.float().backward(do)
        return [o.float()] + [x.grad.float() for x in leaves]

    truth = run("torch", "sdpa", torch.float32)
    ours, sdpa = run("triton", "flash", torch.bfloat16), run("triton", "sdpa", torch.bfloat16)
    for a, b, t in zip(ours, sdpa, truth, strict=True):
        err, err_sdpa = ((a - t).norm() / t.norm()).item(), ((b - t).norm() / t.norm()).item()
        assert err < 1e-2 and err <= 1.5 * err_sdpa + 1e-3, (err, err_sdpa)
    o = causal_attention(q, k, v, 192**-0.5, cu_seqlens=cu, backend="triton", kernel="flash")
    ref = causal_attention(q.float(), k.float(), v.float(), 192**-0.5, cu_seqlens=cu, backend="torch")
    assert ((o - ref).norm() / ref.norm()).item() < 1e-2
