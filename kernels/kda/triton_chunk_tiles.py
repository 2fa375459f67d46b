"""Shared pieces of the chunk KDA kernels (``triton_chunk.py``): the chunk and sub-tile sizes and the
16x16 block helpers (load, store, fp32 product, the inverse of I + a strictly-lower block)."""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64  # chunk size (host side)
BT = tl.constexpr(CHUNK)  # the same, visible inside kernels
BS = tl.constexpr(16)  # sub-tile size


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tri_inverse16(Ablk, BLK: tl.constexpr):
    """(I + A)^-1 of a 16x16 strictly-lower A: A is nilpotent (A^16 = 0), so the Neumann series is
    finite and factors as  sum_{i<16} (-A)^i = (I - A)(I + A^2)(I + A^4)(I + A^8)  (6 small products
    instead of 15 serial substitution steps)."""
    r = tl.arange(0, BLK)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    X = eye - Ablk
    P = _mm(Ablk, Ablk)  # A^2
    X += _mm(X, P)
    P = _mm(P, P)  # A^4
    X += _mm(X, P)
    P = _mm(P, P)  # A^8
    X += _mm(X, P)
    return X


@triton.jit
def _load_blk(ptr, start, eos, r0, c0, H, i_h):
    """16x16 block (rows r0.., cols c0..) of a per-chunk [64 x 64] matrix stored as [T, H, 64]."""
    r = tl.arange(0, BS)
    rows = start + r0 + r
    return tl.load(
        ptr + rows[:, None] * (H * BT) + i_h * BT + c0 + r[None, :], mask=(rows < eos)[:, None], other=0.0
    )


@triton.jit
def _store_blk(ptr, X, start, eos, r0, c0, H, i_h):
    r = tl.arange(0, BS)
    rows = start + r0 + r
    tl.store(ptr + rows[:, None] * (H * BT) + i_h * BT + c0 + r[None, :], X, mask=(rows < eos)[:, None])
