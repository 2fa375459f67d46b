"""MXFP8 activations and the fake quantisation of K3's precision recipe (docs/model.md §5.3, §9.8: QAT
with MXFP4 weights and MXFP8 activations), beside `mxfp4.py` (the weights' format).

MXFP8 after the OCP Microscaling spec v1.0 (§5, §6.3): a block of 32 consecutive values along the
contraction (last) dimension shares one E8M0 scale; each value is an FP8 E4M3 element:

    E4M3   sign | 4 exponent bits (bias 7) | 3 mantissa bits; normals 2^-6 .. 448 = 1.75 * 2^8,
           subnormals k * 2^-9 (k = 1..7), no infinity, S.1111.111 is NaN
    scale  X = floor(log2 amax) - 8        (amax = max |x| of the block, 8 = E4M3's emax)
           clamped to E8M0's [-127, 127]; a block of zeros gets X = -127 (byte 0); a block holding
           inf or NaN gets E8M0's NaN (byte 255), and all its values dequantise to NaN
    value  element = x / 2^X rounded to the nearest E4M3 value, ties to the even mantissa, saturating
           to +-448 (so amax / 2^X in [256, 512) lands at 256..448)

Dequantising is exact in fp32, and in bf16 for scale bytes >= 3 (X >= -124: an element's last bit,
2^(X-9), stays above 2^-133, where bf16's subnormals end); quantising dequantised values gives the
same bytes back.

`fake_mxfp8` / `fake_mxfp4` are what the routed experts run on under `expert_precision: mxfp4`
(moe.py), in the learner and in the engine alike: the quantised values in the forward and, in the
backward, the straight-through estimator (the gradient passes to the unquantised tensor unchanged).
"""

from __future__ import annotations

import torch

from . import mxfp4

GROUP = 32  # values per E8M0 scale
SCALE_BIAS = 127
SCALE_NAN = 255  # E8M0's NaN byte
E4M3_EMAX = 8  # 448 = 1.75 * 2^8
E4M3_EMIN = -6  # the smallest normal exponent; below it the step stays 2^-9 (subnormals)
E4M3_MANTISSA_BITS = 3
E4M3_MAX = 448.0


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """y (fp32) rounded to the nearest E4M3 value, ties to even, saturating to +-448 (NaN stays NaN).

    In the binade [2^E, 2^(E+1)) the E4M3 values are 2^(E-3) apart, E >= -6 (below that the
    subnormals keep the step 2^-9): q = round_half_even(|y| / 2^(E-3)) * 2^(E-3); a mantissa
    rounding up to 2^(E+1) is the next binade's first value, so it needs no special case.
    """
    a = y.abs()
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1): the binade's exponent E = e - 1
    step_exp = (e - 1).clamp(min=E4M3_EMIN) - E4M3_MANTISSA_BITS
    q = torch.ldexp(torch.round(torch.ldexp(a, -step_exp)), step_exp)  # torch.round: half to even
    return torch.copysign(q.clamp(max=E4M3_MAX), y)  # inf saturates too (its block's scale is NaN)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (float, n % 32 == 0) -> (elements float8_e4m3fn [..., n], scale uint8 [..., n/32])."""
    if not x.is_floating_point() or x.shape[-1] % GROUP:
        raise ValueError(f"MXFP8 quantises float tensors whose last dimension is a multiple of {GROUP}; "
                         f"got {x.dtype} of shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP)
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # floor(log2 amax) = e - 1, exactly (no rounding of a log2)
    shared = (e - 1 - E4M3_EMAX).clamp(-SCALE_BIAS, SCALE_BIAS)  # X = floor(log2 amax) - emax_elem
    shared = torch.where(amax == 0, -SCALE_BIAS, shared)  # a block of zeros: the smallest scale
    finite = torch.isfinite(amax)
    shared = torch.where(finite, shared, 0)  # NaN / inf blocks: any finite X for the elements, scale NaN
    elements = round_e4m3(torch.ldexp(blocks, -shared[..., None].float()))
    scale = torch.where(finite, shared + SCALE_BIAS, SCALE_NAN).to(torch.uint8)
    return elements.flatten(-2).to(torch.float8_e4m3fn), scale


def mxfp8_dequantize(elements: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(elements float8_e4m3fn [..., n], scale uint8 [..., n/32]) -> [..., n] in `dtype`: element * 2^(s - 127)."""
    if elements.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP8 elements are float8_e4m3fn and scales uint8, got {elements.dtype} and {scale.dtype}")
    if elements.shape[:-1] != scale.shape[:-1] or elements.shape[-1] != scale.shape[-1] * GROUP:
        raise ValueError(f"MXFP8 elements {tuple(elements.shape)} and scale {tuple(scale.shape)} do not match: "
                         f"a row of n values has n/{GROUP} scales")
    values = elements.float().reshape(*scale.shape, GROUP)
    factor = torch.ldexp(torch.ones_like(scale, dtype=torch.float32), scale.to(torch.int32) - SCALE_BIAS)
    factor = torch.where(scale == SCALE_NAN, torch.nan, factor)
    return (values * factor[..., None]).flatten(-2).to(dtype)


class _StraightThrough(torch.autograd.Function):
    """forward: quantised(x); backward: the gradient unchanged (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, quantised):
        return quantised(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mxfp8_values(x: torch.Tensor) -> torch.Tensor:
    return mxfp8_dequantize(*mxfp8_quantize(x), x.dtype)


def _mxfp4_values(w: torch.Tensor) -> torch.Tensor:
    return mxfp4.dequantize(*mxfp4.quantize(w), w.dtype)


def fake_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x's values after an MXFP8 round trip (blocks of 32 along the last dimension), in x's dtype;
    gradients pass straight through."""
    return _StraightThrough.apply(x, _mxfp8_values)


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """w's values after an MXFP4 round trip (mxfp4.py, blocks of 32 along the last dimension), in w's
    dtype; gradients pass straight through to w (the master weight)."""
    return _StraightThrough.apply(w, _mxfp4_values)
