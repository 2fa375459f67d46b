"""The fused decode-experts kernels (kernels/moe/triton_decode_experts.py) on the CPU under
TRITON_INTERPRET=1, against decode_experts_reference: fp32 and bf16, l and f not powers of two and larger
than the blocks (several reduction steps and programs, masked tails), experts repeated across tokens and
within a row of idx.

Run by test_decode_experts_kernel.py in a fresh process (TRITON_INTERPRET=1 must be set before triton is
imported). bf16 runs inside interpret_cases.gpu_like_bf16 (the interpreter's bf16 casts as the GPU's).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.moe import triton_decode_experts as tde  # noqa: E402
from k3rl.kernels.moe.triton_decode_experts import decode_experts_reference, decode_experts_triton  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(tde.gate_up_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)

L, F, BG, BU = 40, 24, 4.0, 25.0  # l = 40, f = 24 over blocks of 16: 3 and 2 steps, masked tails


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    for name in ("BLOCK_F1", "BLOCK_L1", "BLOCK_L2", "BLOCK_F2"):
        monkeypatch.setattr(tde, name, 16)


def inputs(N, k, E, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen).to(dtype)
    w1 = (torch.randn(E, F, L, generator=gen) * 2 / L**0.5).to(dtype)  # gates of a few units: SiTU's bend
    w3 = (torch.randn(E, F, L, generator=gen) * 20 / L**0.5).to(dtype)  # ups up to ~b2: tanh(u/b2) bends too
    w2 = (torch.randn(E, L, F, generator=gen) / F**0.5).to(dtype)
    idx = torch.randint(0, E, (N, k), generator=gen)
    if k > 1:
        idx[0, : k // 2 + 1] = E - 1  # an expert repeated within a row
    idx[-1, 0] = idx[0, -1]  # and across tokens
    p = torch.softmax(torch.randn(N, k, generator=gen), -1)
    return z, idx, p, w1, w3, w2


@pytest.mark.parametrize("N, k, E", [(1, 1, 5), (1, 4, 8), (3, 1, 8), (3, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_experts_kernel_matches_reference(N, k, E, dtype):
    args = inputs(N, k, E, dtype, seed=N * 100 + k * 10 + E)
    with gpu_like_bf16():
        y = decode_experts_triton(*args, BG, BU)
    ref = decode_experts_reference(*args, BG, BU)
    assert y.shape == (N, L) and y.dtype == dtype
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    print(f"N={N} k={k} E={E} {dtype}: max |y - ref| = {err:.3g} (max |ref| = {scale:.3g})")
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * scale)
        return
    # bf16: the fp32 dots sum in another order, so a rounded g, u or h can land one bf16 ulp away
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=2**-8 * scale)
    assert (y != ref).float().mean().item() < 0.1


def test_decode_experts_kernel_weights_routes_in_order():
    """Each route's output is weighted by its own p: swapping two p columns (different experts) changes
    y, and the kernel follows the reference to the swapped result."""
    z, idx, p, w1, w3, w2 = inputs(3, 4, 8, torch.float32, seed=7)
    idx[:, 1], idx[:, 2] = 1, 6
    p[:, 2] = p[:, 1] + 0.3  # different weights on the two slots
    swapped = p[:, [0, 2, 1, 3]]
    y = decode_experts_triton(z, idx, p, w1, w3, w2, BG, BU)
    y_swapped = decode_experts_triton(z, idx, swapped, w1, w3, w2, BG, BU)
    assert (y - y_swapped).abs().max().item() > 1e-2
    torch.testing.assert_close(y_swapped, decode_experts_reference(z, idx, swapped, w1, w3, w2, BG, BU),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # and each expert's weights are its own: the expert of a route matters
    idx2 = idx.clone()
    idx2[0, 3] = (idx[0, 3] + 1) % 8
    y2 = decode_experts_triton(z, idx2, p, w1, w3, w2, BG, BU)
    assert (y2[0] - y[0]).abs().max().item() > 1e-2 and torch.equal(y2[1:], y[1:])
