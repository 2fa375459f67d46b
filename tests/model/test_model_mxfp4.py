"""MXFP4 (k3rl/model/mxfp4.py): the byte layout against hand-computed E2M1 / E8M0 tables, the
scale and rounding rules, error bounds, and that values out of a checkpoint survive a re-quantisation."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import mxfp4


def _row(*bytes_: int) -> torch.Tensor:
    """One row of 32 values: the given bytes, then zero bytes."""
    return torch.tensor(list(bytes_) + [0] * (16 - len(bytes_)), dtype=torch.uint8)[None]


def test_unpacking_follows_the_e2m1_table_low_nibble_first():
    # byte 0xBA: low nibble 0xA = -1.0 (sign 1, exponent 01, mantissa 0), high nibble 0xB = -1.5
    packed = _row(0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] + [0.0] * 16
    for scale_byte, factor in ((127, 1.0), (128, 2.0), (124, 0.125), (137, 1024.0)):
        got = mxfp4.dequantize(packed, torch.tensor([[scale_byte]], dtype=torch.uint8), torch.float32)
        assert got[0].tolist() == [v * factor for v in table], scale_byte
    assert bool(torch.signbit(mxfp4.dequantize(packed, torch.tensor([[127]], dtype=torch.uint8), torch.float32)[0, 8]))
    assert mxfp4.unpack_codes(torch.tensor([0x93, 0xF4], dtype=torch.uint8)).tolist() == [3, 9, 4, 15]
    assert mxfp4.pack_codes(torch.tensor([3, 9, 4, 15], dtype=torch.uint8)).tolist() == [0x93, 0xF4]
    assert mxfp4.dequantize(packed, torch.tensor([[127]], dtype=torch.uint8)).dtype == torch.bfloat16


def test_quantising_rounds_to_nearest_with_ties_to_the_even_code():
    # amax 6 -> scale 2^0 (byte 127); each value's code by hand:
    #   6 -> 7;  -3 -> 8|5 = 13;  0.7 -> 0.5 (1);  0.25 tie 0/0.5 -> 0 (0);  0.75 tie 0.5/1 -> 1 (2);
    #   1.25 tie 1/1.5 -> 1 (2);  1.75 tie 1.5/2 -> 2 (4);  2.5 tie 2/3 -> 2 (4);  3.5 tie 3/4 -> 4 (6);  5 tie 4/6 -> 4 (6)
    x = torch.tensor([6.0, -3.0, 0.7, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 22)
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [127]
    assert packed.tolist() == [0xD7, 0x01, 0x22, 0x44, 0x66] + [0] * 11
    assert mxfp4.dequantize(packed, scale, torch.float32)[:10].tolist() == [6, -3, 0.5, 0, 1, 1, 2, 2, 4, 4]


def test_negative_values_round_ties_to_the_even_code_and_saturate_like_positive_ones():
    # amax 6.9 -> scale 2^0 (byte 127, 6.9 = 1.725 * 2^2 is below the 1.75 that rounds up); codes by hand:
    #   -6.9 saturates -> -6 (8|7 = 15);  -0.25 tie 0/0.5 -> -0 (8);  -0.75 tie -> -1 (10);  -1.25 tie -> -1 (10);
    #   -1.75 tie -> -2 (12);  -2.5 tie -> -2 (12);  -3.5 tie -> -4 (14);  -5 tie -> -4 (14);  -5.5 -> -6 (15);  -0.3 -> -0.5 (9)
    x = torch.tensor([-6.9, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -5.5, -0.3] + [0.0] * 22)
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [127]
    assert packed.tolist() == [0x8F, 0xAA, 0xCC, 0xEE, 0x9F] + [0] * 11
    back = mxfp4.dequantize(packed, scale, torch.float32)[:10]
    assert back.tolist() == [-6, 0, -1, -1, -2, -2, -4, -4, -6, -0.5] and bool(torch.signbit(back[1]))


@pytest.mark.parametrize(("amax", "scale_byte", "top"), [
    (6.0, 127, 6.0),        # 6 = 1.5 * 2^2: e = 2 - 2 = 0
    (6.9, 127, 6.0),        # 1.725 * 2^2, below 1.75: e = 0, 6.9 saturates to 6
    (7.0, 128, 8.0),        # 1.75 * 2^2 rounds the block max up to 2^3: e = 1, 7 / 2 = 3.5 -> 4
    (1.0, 125, 1.0),        # 2^0: e = -2, 1 / 2^-2 = 4
    (0.0, 124, 0.0),        # an all-zero block
    (2.0**-140, 0, 0.0),    # below E8M0's range: the smallest scale, the value underflows to 0
])
def test_the_e8m0_scale_puts_the_block_max_near_4_to_6(amax, scale_byte, top):
    x = torch.zeros(2, 32)
    x[:, 5] = amax
    x[1, 7] = -amax / 3
    packed, scale = mxfp4.quantize(x)
    assert scale.tolist() == [[scale_byte], [scale_byte]]
    assert mxfp4.dequantize(packed, scale, torch.float32)[0, 5].item() == top


def test_quantisation_error_is_bounded_by_the_block_scale():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    w[3] *= 50  # rows of very different magnitude: each block has its own scale
    packed, scale = mxfp4.quantize(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    back = mxfp4.dequantize(packed, scale, torch.float32)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)  # 2^e of each value's block
    err = (back - w).abs()
    assert bool((err <= step).all())  # half the widest gap of the E2M1 grid (4 -> 6) times 2^e, saturation included
    small = w.abs() <= 2 * step  # on the fine part of the grid (0, 0.5, 1, 1.5, 2) the error is at most 0.25 * 2^e
    assert bool((err[small] <= 0.25 * step[small]).all())
    amax = w.reshape(64, 8, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    assert bool((err <= amax / 3.5).all())  # relative to the block: 2^e <= amax / 3.5
    assert ((back - w).norm() / w.norm()).item() < 0.15  # about 11% for Gaussian weights


def test_values_from_a_checkpoint_are_stored_again_exactly():
    torch.manual_seed(1)
    packed = torch.randint(0, 256, (16, 64), dtype=torch.uint8)
    scale = torch.randint(100, 150, (16, 4), dtype=torch.uint8)
    values = mxfp4.dequantize(packed, scale, torch.float32)
    again = mxfp4.dequantize(*mxfp4.quantize(values), torch.float32)
    assert torch.equal(again, values)
    assert torch.equal(mxfp4.dequantize(packed, scale, torch.bfloat16).float(), values)  # exact in bf16 too
    # what k3rl itself quantised comes back byte for byte (each block's largest code is 4 or 6)
    w = torch.randn(8, 96, dtype=torch.bfloat16)
    p, s = mxfp4.quantize(w)
    p2, s2 = mxfp4.quantize(mxfp4.dequantize(p, s))
    assert torch.equal(p, p2) and torch.equal(s, s2)


def test_bad_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4.quantize(torch.tensor([float("inf")] + [0.0] * 31))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.uint8))
    mxfp4.check_quantization_config(mxfp4.quantization_config(), "config.json")
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}
    with pytest.raises(ValueError, match="'pack-quantized' is not one k3rl reads"):
        mxfp4.check_quantization_config(int4, "config.json")
