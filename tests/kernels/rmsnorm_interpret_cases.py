"""The fused RMSNorm kernel on the CPU under TRITON_INTERPRET=1: the output and both gradients against
the PyTorch reference (fp32, bf16 and fp16 rows; an fp32 weight on bf16 rows, as autocast gives them).

Run by test_rmsnorm_kernel.py in a fresh process (TRITON_INTERPRET=1 must be set before triton is
imported). bf16 runs inside interpret_cases.gpu_like_bf16 (the interpreter's bf16 casts as the GPU's).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.rmsnorm import rms_norm, rms_norm_reference, triton_rmsnorm  # noqa: E402
from k3rl.model.common import RMSNorm  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(triton_rmsnorm.rms_norm_fwd_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)


def run(fn, x, w, dy):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(1, 37, 64), (2, 19, 96), (3, 7, 1000)])  # ragged rows, a non-power-of-2 d
@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
                         ids=["fp32", "bf16", "bf16-fp32-weight", "fp16"])  # fmt: skip
def test_rms_norm_triton_matches_reference(shape, dtype, wdtype, monkeypatch):
    monkeypatch.setattr(triton_rmsnorm, "ROWS", 256)  # several rows per block, a partial last block,
    monkeypatch.setattr(triton_rmsnorm, "MAX_PROGRAMS", 3)  # several row blocks per backward program
    gen = torch.Generator().manual_seed(shape[-1])
    scale = torch.rand(*shape[:-1], 1, generator=gen) * 4 + 0.1  # rows of different scales: r matters
    x = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(wdtype)
    dy = torch.randn(*shape, generator=gen).to(dtype)
    with gpu_like_bf16():
        y1, dx1, dw1 = run(lambda a, b: rms_norm(a, b, 1e-6, backend="triton"), x, w, dy)
    y2, dx2, dw2 = run(lambda a, b: rms_norm_reference(a, b, 1e-6), x, w, dy)
    assert (y1.dtype, dx1.dtype, dw1.dtype) == (dtype, dtype, wdtype)
    if dtype == torch.float32:
        torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx1, dx2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw1, dw2, rtol=1e-5, atol=1e-4)
        return
    # the forward rounds as the reference does (n to x's dtype, then w n): equal but for the rare row
    # whose fp32 statistic lands on the other side of a rounding boundary (another summation order)
    assert (y1 != y2).float().mean().item() < 0.01
    torch.testing.assert_close(y1.float(), y2.float(), rtol=2**-7, atol=1e-3)
    # gradients: the kernel keeps dn = dy w and the dw sum in fp32, the reference rounds them to x's
    # dtype; both against the fp32 truth, the kernel's error no larger than the reference's (+ slack)
    yt, dxt, dwt = run(lambda a, b: rms_norm_reference(a, b, 1e-6), x.float(), w.to(dtype).float(), dy.float())
    for ours, ref, truth, what in ((dx1, dx2, dxt, "dx"), (dw1, dw2, dwt, "dw")):
        assert rel_err(ours, truth) <= 1.5 * rel_err(ref, truth) + 2e-3, (what, rel_err(ours, truth), rel_err(ref, truth))


def test_rms_norm_module_on_the_kernel_and_on_the_reference():
    """The model's RMSNorm module with backend 'triton' (the kernel) and 'torch' (the reference) agree."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-5, backend="triton")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    x = torch.randn(5, 48, generator=gen)
    y = norm(x)
    norm.backend = "torch"
    torch.testing.assert_close(y, norm(x), rtol=1e-6, atol=1e-6)
