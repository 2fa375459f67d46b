"""MXFP4, the storage of the release's routed experts (docs/model.md §12).

A weight [rows, n] (n a multiple of 32) is stored as two uint8 tensors:

    weight_packed  [rows, n / 2]    two FP4 E2M1 codes per byte: value 2j in the low nibble, 2j+1 in the high
    weight_scale   [rows, n / 32]   one E8M0 scale per 32 consecutive values of a row: byte s means 2^(s - 127)

    value = E2M1[code] * 2^(s - 127)

An E2M1 code is sign (bit 3) | exponent (bits 2-1, bias 1) | mantissa (bit 0):

    code   0    1    2    3    4    5    6    7        8 .. 15: the same magnitudes, negative
    value  0    0.5  1    1.5  2    3    4    6

Quantising a block of 32 values x (what `quantize` does, and how the release was written by
compressed-tensors' `mxfp4-pack-quantized`):
    e = floor(log2 amax) - 2, where amax = max|x| is first rounded to a power of two (a mantissa
        of 1.75 or more rounds up), so the block's largest value lands near 4..6
    code = round-to-nearest E2M1 of x / 2^e (ties to the even code), saturating at 6
Dequantising is exact in bf16 and fp32; quantising values that came out of `dequantize` gives
them back exactly (the scale may come out different when a block's largest code is below 4, the
values never do).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per E8M0 scale
SCALE_BIAS = 127
FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name for this layout

# E2M1 magnitudes by code; codes 8-15 are the negatives of 0-7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# round to nearest, ties to the even code: |y| passes the boundary between codes c and c+1 at
# the midpoint, with `>` when c is even (a tie stays at c) and `>=` when c is odd (a tie goes up)
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def quantization_config() -> dict:
    """The `quantization_config` section of config.json for MXFP4 routed experts (compressed-tensors
    layout, as the release writes it under `text_config`); everything but the experts is ignored."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax", "actorder": None,
               "block_structure": None, "observer_kwargs": {}, "zp_dtype": None}
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": FORMAT}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                   r"re:.*block_sparse_moe\.routed_expert_(down|up)_proj.*", r"re:.*block_sparse_moe\.gate$",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
    }


def check_quantization_config(section: dict | None, where: str) -> None:
    """Refuse a quantization section k3rl cannot read (anything but MXFP4 weights in groups of 32)."""
    if not section:
        return
    fmt, method = section.get("format"), section.get("quant_method")
    groups = section.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    ok = (method == "compressed-tensors" and fmt == FORMAT and weights
          and all(w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == GROUP for w in weights))
    if not ok:
        raise ValueError(
            f"{where}: quantization_config {method!r} / {fmt!r} is not one k3rl reads; k3rl loads routed experts "
            f"stored as compressed-tensors '{FORMAT}' (FP4 E2M1 weights, E8M0 scales per {GROUP} values) or "
            f"unquantised; dequantise the checkpoint first"
        )


def _codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) of y, already divided by its block scale."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for mid, tie_up in _MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n / 2] bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., n / 2] bytes -> [..., n] codes (the inverse of `pack_codes`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] (float, n % 32 == 0) -> (weight_packed uint8 [..., n/2], weight_scale uint8 [..., n/32])."""
    if not w.is_floating_point() or w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 quantises float tensors whose last dimension is a multiple of {GROUP}; "
                         f"got {w.dtype} of shape {tuple(w.shape)}")
    blocks = w.float().reshape(*w.shape[:-1], -1, GROUP)
    amax = blocks.abs().amax(-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("MXFP4 cannot store inf or NaN: the weight has non-finite values")
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype) - 2  # floor(log2 amax), rounded at 1.75, minus 2
    e = e.clamp(-SCALE_BIAS, SCALE_BIAS)  # byte 255 is E8M0's NaN
    codes = _codes(torch.ldexp(blocks, -e[..., None].float()))
    return pack_codes(codes.flatten(-2)), (e + SCALE_BIAS).to(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(weight_packed [..., n/2], weight_scale [..., n/32]) -> the weight [..., n] in `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed and weight_scale are uint8, got {packed.dtype} and {scale.dtype}")
    n = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or n != scale.shape[-1] * GROUP:
        raise ValueError(f"MXFP4 weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do not "
                         f"match: a row of n values has n/2 bytes and n/{GROUP} scales")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    values = lut[unpack_codes(packed).long()].reshape(*scale.shape, GROUP)
    values = torch.ldexp(values, scale.to(torch.int32)[..., None].float() - SCALE_BIAS)
    return values.flatten(-2).to(dtype)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (weight_packed, weight_scale) for a weight of `shape`."""
    *rows, n = shape
    if n % GROUP:
        raise ValueError(f"MXFP4 needs a last dimension that is a multiple of {GROUP}, got shape {tuple(shape)}")
    return (*rows, n // 2), (*rows, n // GROUP)
