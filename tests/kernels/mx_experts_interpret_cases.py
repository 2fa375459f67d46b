"""The MXFP4-expert kernels (kernels/moe/triton_mx_experts.py) on the CPU under TRITON_INTERPRET=1, against
their references: the MXFP8 quantiser against k3rl/model/mx.py byte for byte (hand table, wide random
values, edge blocks), and both expert paths against the engine's reference path (RoutedExperts.forward on
held MXFP4 bytes, k3rl/model/moe.py) bit for bit, in fp32 and bf16; RoutedExperts with the Triton backend
takes the kernels.

Run by test_mx_experts_kernel.py in a fresh process (TRITON_INTERPRET=1 must be set before triton is
imported). bf16 runs inside interpret_cases.gpu_like_bf16 (the interpreter's bf16 casts and dots as the GPU's).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.moe import triton_mx_experts as tmx  # noqa: E402
from k3rl.model import mx  # noqa: E402
from k3rl.model.moe import RoutedExperts  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(tmx.mx_decode_gate_up_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)

# l = 96 over steps of 64 (a masked tail block), f = 64 over 32-row programs; E = 5 experts
L, F, E, BG, BU = 96, 64, 5, 4.0, 25.0


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    for name, value in (("BLOCK_F1", 32), ("BLOCK_L1", 64), ("BLOCK_L2", 32), ("BLOCK_F2", 32), ("BLOCK_M", 16),
                        ("BLOCK_N", 32), ("BLOCK_K", 64), ("BLOCK_Q", 64)):  # fmt: skip
        monkeypatch.setattr(tmx, name, value)


def held_experts(read_dtype, backend="torch", seed=0):
    """RoutedExperts holding MXFP4 bytes (as an engine under expert_precision mxfp4), quantised from fp32."""
    cfg = SimpleNamespace(num_experts=E, moe_intermediate_size=F, routed_expert_hidden_size=L,
                          activation_situ_beta=BG, activation_situ_linear_beta=BU, kernel_backend=backend,
                          expert_precision="mxfp4")  # fmt: skip
    m = RoutedExperts(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.w1.copy_(torch.randn(E, F, L, generator=gen) * 2 / L**0.5)  # gates of a few units: SiTU's bend
        m.w3.copy_(torch.randn(E, F, L, generator=gen) * 20 / L**0.5)  # ups up to ~b2: tanh(u/b2) bends too
        m.w2.copy_(torch.randn(E, L, F, generator=gen) / F**0.5)
        m.w2[1, :, 32:] *= 1e-3  # a block of W2 with its own, much smaller scale
    m.hold_mxfp4_(read_dtype=read_dtype)
    return m


def routes(N, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen)
    z[0, 32:64] *= 1e-4  # a block of z far below the others: its own scale
    idx = torch.randint(0, E - 1, (N, k), generator=gen)  # expert E - 1 gets no route
    idx[0, : k // 2 + 1] = 2  # an expert repeated within a row
    idx[-1, 0] = idx[0, -1]  # and across tokens
    p = torch.softmax(torch.randn(N, k, generator=gen), -1)
    return z.to(dtype), idx, p


def held(m):
    return [getattr(m, f"{n}_{part}") for n in m.NAMES for part in ("packed", "scale")]


def test_quantiser_kernel_is_mx_py_byte_for_byte():
    # the hand table of tests/model/test_model_mxfp8.py (amax 256 -> X = 0): ties to even, saturation, subnormals
    cases = [1.0625, 1.1875, 1.07, 17.0, 19.0, -19.0, 1.96875, 448.0, 464.0, 500.0, -511.0, 2.0**-6, 2.0**-9,
             2.0**-10, 3 * 2.0**-10, 2.0**-11, -(2.0**-12), 256.0]  # fmt: skip
    want = [1.0, 1.25, 1.125, 16.0, 20.0, -20.0, 2.0, 448.0, 448.0, 448.0, -448.0, 2.0**-6, 2.0**-9, 0.0, 2.0**-8,
            0.0, -0.0, 256.0]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=gen) * torch.exp2(torch.randint(-30, 30, (6, 128), generator=gen).float())
    x[0, : len(cases)] = torch.tensor(cases)
    x[0, len(cases) : 32] = 0.0
    x[1, :32] = 0.0  # a block of zeros: byte 0
    x[1, 32:64] = 2.0**-140  # below E8M0's range: byte 0, values to 0
    x[1, 64:96] *= 0
    x[1, 64] = 3.0e38  # fp32's top binade: X = 119
    x[2, 33] = float("inf")  # E8M0's NaN (255) for its block
    x[3, 100] = float("nan")
    el, sc = tmx.mxfp8_quantize_triton(x)
    ref_el, ref_sc = mx.mxfp8_quantize(x)
    assert el.dtype == torch.float8_e4m3fn and sc.dtype == torch.uint8
    assert sc[0, 0].item() == 127 and el[0, : len(cases)].float().tolist() == want
    assert bool(torch.signbit(el[0, 16].float()))  # -0 stays -0
    assert sc[1].tolist() == [0, 0, 246, ref_sc[1, 3].item()] and sc[2, 1].item() == 255 and sc[3, 3].item() == 255
    assert torch.equal(sc, ref_sc)
    finite = torch.isfinite(x).reshape(6, 4, 32).all(-1).repeat_interleave(32, dim=1)  # NaN blocks: scale only
    assert torch.equal(el.view(torch.uint8)[finite], ref_el.view(torch.uint8)[finite])
    xb = x.nan_to_num(0.0).clamp(-1e30, 1e30).bfloat16()  # bf16 input: the same bytes as mx.py's
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(tmx.mxfp8_quantize_triton(xb), mx.mxfp8_quantize(xb), strict=True))  # fmt: skip


@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_expert_kernels_equal_the_engines_reference(path, dtype):
    """bf16 (the engine's dtype on a GPU): bit for bit. fp32: the GEMMs' fp32 sums, in the kernels' order and
    not rounded to a narrower dtype after, keep their order's last bits: equal here, but on other data up to 1
    value in 8 differed by ~1e-7 relative (and once, of 12 cases, an activation moved across an MXFP8 rounding
    midpoint: 1.8e-4 relative); in bf16 no difference in those 12 cases."""
    N, k = (2, 2) if path == "decode" else (12, 2)
    m = held_experts(dtype)
    z, idx, p = routes(N, k, dtype, seed=N * 10 + k)
    if path == "grouped":  # 18 routes to expert 2: a group over two 16-row tiles, beside smaller groups
        idx[:, 0], idx[:6, 1] = 2, 2
    ref = m(z, idx, p)  # the reference path: mxfp4.dequantize'd weights, fake_mxfp8 z and SiTU-GLU output
    fn = tmx.mx_decode_experts_triton if path == "decode" else tmx.mx_grouped_experts_triton
    with gpu_like_bf16():
        y = fn(z, idx, p, *held(m), BG, BU)
    assert y.dtype == dtype and y.shape == (N, L) and ref.abs().max().item() > 1.0
    print(f"{path} {dtype}: {(y != ref).sum().item()} of {y.numel()} values differ, "
          f"max |y - ref| = {(y.float() - ref.float()).abs().max().item():.3g}")
    if dtype == torch.bfloat16:
        assert torch.equal(y, ref)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_routed_experts_take_the_kernels_on_the_triton_backend_under_autocast():
    """RoutedExperts' held bytes with backend 'triton' (CUDA, or here the interpreter) run the kernels: the
    reference's result, here fp32-held bytes computed in autocast's bf16; one route (4 <= E) takes the decode path."""
    ours, ref = held_experts(torch.float32, backend="triton"), held_experts(torch.float32)
    z, idx, p = routes(1, 1, torch.float32, seed=5)
    calls = []
    real = tmx.mx_decode_experts_triton
    with pytest.MonkeyPatch.context() as mp, gpu_like_bf16(), torch.autocast("cpu", dtype=torch.bfloat16):
        mp.setattr(tmx, "mx_decode_experts_triton", lambda *a: calls.append(1) or real(*a))
        y, want = ours(z, idx, p), ref(z, idx, p)
    assert calls and y.dtype == torch.bfloat16 and torch.equal(y, want)
