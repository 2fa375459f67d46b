"""MXFP8 (k3rl/model/mx.py, OCP Microscaling v1.0): E4M3 rounding and the E8M0 scale against hand tables,
NaN / inf / zero blocks, round trips and idempotence, and the straight-through fake quantisation."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import mx, mxfp4


def _block(*values: float, amax: float = 256.0) -> torch.Tensor:
    """One block of 32: the values, then `amax` (which fixes the scale), then zeros."""
    return torch.tensor(list(values) + [amax] + [0.0] * (31 - len(values)))


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return mx.mxfp8_dequantize(*mx.mxfp8_quantize(x), torch.float32)


def test_e4m3_rounds_to_nearest_with_ties_to_the_even_mantissa_and_saturates():
    # amax 256 -> X = 8 - 8 = 0 (byte 127): the elements are the values themselves
    cases = [  # (value, E4M3 value) by hand; near 1 the step is 2^-3, near 16 it is 2, near 256 it is 32
        (1.0625, 1.0),      # tie 1.0 (mantissa 000) / 1.125 (001): the even one
        (1.1875, 1.25),     # tie 1.125 (001) / 1.25 (010)
        (1.07, 1.125),      # past the midpoint: up
        (17.0, 16.0),       # tie 16 (000) / 18 (001)
        (19.0, 20.0),       # tie 18 (001) / 20 (010)
        (-19.0, -20.0),     # the sign is kept
        (1.96875, 2.0),     # tie 1.875 (111) / 2.0: the mantissa carries into the next binade
        (448.0, 448.0),     # the largest E4M3 value, 1.75 * 2^8
        (464.0, 448.0),     # tie 448 / 480 (480 is NaN's code in E4M3): saturates
        (500.0, 448.0),     # beyond: saturates
        (-511.0, -448.0),   # (512 would raise the scale)
        (2.0**-6, 2.0**-6),  # the smallest normal
        (2.0**-9, 2.0**-9),  # the smallest subnormal
        (2.0**-10, 0.0),    # tie 0 / 2^-9: zero is even
        (3 * 2.0**-10, 2.0**-8),  # tie 2^-9 (subnormal 001) / 2^-8 (010)
        (2.0**-11, 0.0),    # below half the smallest subnormal: zero
    ]
    x = _block(*[v for v, _ in cases])
    elements, scale = mx.mxfp8_quantize(x)
    assert scale.tolist() == [127] and elements.dtype == torch.float8_e4m3fn
    assert elements.float()[: len(cases)].tolist() == [q for _, q in cases]
    assert _round_trip(x)[: len(cases)].tolist() == [q for _, q in cases]
    assert bool(torch.signbit(_round_trip(_block(-(2.0**-12)))[0]))  # -0 stays -0


def test_e4m3_rounding_agrees_with_torchs_float8_cast_in_range():
    torch.manual_seed(0)
    y = torch.randn(20000) * torch.exp2(torch.randint(-14, 10, (20000,)).float())
    y = y.clamp(-448, 448)  # torch's cast turns what is beyond into NaN; the MX elements saturate
    assert torch.equal(mx.round_e4m3(y), y.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize(("amax", "scale_byte"), [
    (448.0, 127),           # floor(log2 448) = 8: X = 8 - 8 = 0
    (256.0, 127),
    (511.9, 127),           # still 2^8: 511.9 saturates to 448
    (512.0, 128),           # 2^9: X = 1
    (1.0, 119),             # X = 0 - 8
    (0.75, 118),            # floor(log2 0.75) = -1
    (2.0**-118, 1),         # X = -126
    (2.0**-140, 0),         # X = -148, clamped to E8M0's smallest, -127; the values underflow to 0
    (0.0, 0),               # a block of zeros: the smallest scale
    (3.0e38, 246),          # fp32's top binade, 2^127: X = 119
    (float("inf"), 255),    # E8M0's NaN
    (float("nan"), 255),
])
def test_the_e8m0_scale_is_floor_log2_amax_minus_8(amax, scale_byte):
    x = torch.zeros(2, 32)
    x[0, 3] = amax
    x[1, 3] = -amax  # the sign does not matter
    x[1, 9] = amax / 7 if amax == amax else 0.0
    _, scale = mx.mxfp8_quantize(x)
    assert scale.tolist() == [[scale_byte], [scale_byte]]
    back = mx.mxfp8_dequantize(*mx.mxfp8_quantize(x), torch.float32)
    if scale_byte == 255:  # NaN scale: the whole block is NaN
        assert bool(back.isnan().all())
    elif amax >= 2.0**-126:
        assert back[0, 3].item() == pytest.approx(min(amax, 448 * 2.0 ** (scale_byte - 127)), rel=2**-4)
    else:
        assert bool((back == 0).all())


def test_blocks_run_along_the_last_dimension_each_with_its_scale():
    x = torch.ones(3, 96)
    x[1, 32:64] *= 1000.0  # the second block of row 1 only
    elements, scale = mx.mxfp8_quantize(x)
    assert elements.shape == (3, 96) and scale.shape == (3, 3)
    assert scale.tolist() == [[119] * 3, [119, 128, 119], [119] * 3]
    assert torch.equal(_round_trip(x), torch.where(x > 1, 896.0, x))  # X = 9 - 8: 1000 / 2 = 500 saturates to 448


def test_round_trip_error_bound_and_idempotence():
    torch.manual_seed(1)
    x = torch.randn(16, 256) * torch.exp2(torch.randint(-20, 20, (16, 1)).float())  # rows of very different size
    elements, scale = mx.mxfp8_quantize(x)
    back = mx.mxfp8_dequantize(elements, scale, torch.float32)
    blocks, amax = x.reshape(16, 8, 32), x.reshape(16, 8, 32).abs().amax(-1, keepdim=True)
    below = blocks.abs() <= 448 * torch.exp2(scale.float() - 127)[..., None]  # not saturated
    err = (back.reshape(16, 8, 32) - blocks).abs()
    assert bool((err[below] <= (blocks.abs() * 2.0**-4)[below] + (2.0**-9 * amax / 256).expand_as(err)[below]).all())
    assert ((back - x).norm() / x.norm()).item() < 0.06
    # quantising dequantised values gives the same bytes back, in fp32 and in bf16
    again = mx.mxfp8_quantize(back)
    assert torch.equal(again[0].view(torch.uint8), elements.view(torch.uint8)) and torch.equal(again[1], scale)
    assert torch.equal(mx.mxfp8_dequantize(elements, scale, torch.bfloat16).float(), back)
    assert torch.equal(_round_trip(back.bfloat16()), back)
    # bf16 holds every element down to a scale byte of 3 (3 * 2^-9 * 2^-124 needs bf16's last subnormals)
    e = torch.full((1, 32), 3 * 2.0**-9).to(torch.float8_e4m3fn)
    for byte, exact in ((3, True), (2, False)):
        s = torch.tensor([[byte]], dtype=torch.uint8)
        assert torch.equal(mx.mxfp8_dequantize(e, s, torch.bfloat16).float(), mx.mxfp8_dequantize(e, s, torch.float32)) == exact


def test_fake_quantisation_keeps_dtype_and_passes_gradients_straight_through():
    torch.manual_seed(2)
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)
    xq, wq = mx.fake_mxfp8(x), mx.fake_mxfp4(w)
    assert torch.equal(xq, _round_trip(x.detach()))
    assert torch.equal(wq, mxfp4.dequantize(*mxfp4.quantize(w.detach()), torch.float32))
    assert torch.equal(mx.fake_mxfp8(xq), xq) and torch.equal(mx.fake_mxfp4(wq), wq)  # idempotent
    g = torch.randn(4, 64)
    (xq * g).sum().backward()
    assert torch.equal(x.grad, g)  # d fq(x) / dx = 1
    assert mx.fake_mxfp8(x.detach().bfloat16()).dtype == torch.bfloat16


def test_bad_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.mxfp8_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mx.mxfp8_dequantize(torch.zeros(4, 32), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mx.mxfp8_dequantize(torch.zeros(4, 64).to(torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.uint8))
