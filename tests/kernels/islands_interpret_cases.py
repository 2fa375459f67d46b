"""The KDA islands' Triton kernels (short convolution, output norm + gate) on the CPU under
TRITON_INTERPRET=1, forward and every gradient against the PyTorch references, fp32 and bf16.

Run by test_kda_islands.py in a fresh process (TRITON_INTERPRET=1 must be set before triton is
imported). bf16 runs inside interpret_cases.gpu_like_bf16 (the interpreter's bf16 casts as the GPU's).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.kda import (  # noqa: E402
    output_norm_gate,
    output_norm_gate_reference,
    short_conv,
    short_conv_reference,
    triton_output_gate,
    triton_short_conv,
)
from k3rl.model import K3Config  # noqa: E402
from k3rl.model.kda import KimiDeltaAttention  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(triton_short_conv.short_conv_fwd_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)

BF16_ULP = 2.0**-7  # a bf16 value's rounding, relative, with a rounding-order difference on either side


def grads(fn, inputs, d_out, wrt):
    leaves = [t.detach().clone().requires_grad_(i in wrt) for i, t in enumerate(inputs)]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(d_out)
    return out, [leaves[i].grad for i in wrt]


def assert_close(a, b, what, rel):
    """|a - b| <= rel |b| + 1e-5 max |b|: rounding of each value (rel) plus fp32 rounding at the tensor's
    scale (a sum of terms that cancel)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    err = (a.float() - b.float()).abs()
    bound = rel * b.float().abs() + 1e-5 * b.float().abs().max()
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item()}, largest value {b.abs().max().item()}"


def check_short_conv(x, w, left, cu, seed):
    """The kernel's y, dx, dweight and new left context against the reference's."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype)
    with gpu_like_bf16():
        y1, (dx1, dw1) = grads(lambda a, b: short_conv(a, b, left, cu, backend="triton"), [x, w], dy, wrt=(0, 1))
        tail = short_conv(x, w, left, cu, backend="triton")[1]
    y2, (dx2, dw2) = grads(lambda a, b: short_conv_reference(a, b, left, cu), [x, w], dy, wrt=(0, 1))
    rel = 1e-5 if x.dtype == torch.float32 else BF16_ULP
    assert_close(y1, y2, "y", rel)
    assert_close(dx1, dx2, "dx", rel)
    assert_close(dw1, dw2, "dweight", 1e-4)  # fp32 sums over the tokens, in another order
    assert torch.equal(tail, short_conv_reference(x, w, left, cu)[1])


@pytest.mark.parametrize(
    "B, lens, C, W",
    [
        (1, [1, 37, 1, 100, 3, 64], 192, 4),  # ragged documents, 1-token ones, C not a multiple of the block
        (2, [150], 64, 4),  # a padded batch of two, no documents
        (1, [2, 1, 60], 256, 2),  # a 2-tap conv
        (1, [300, 5, 260], 64, 3),  # dw summed over several programs' runs of token blocks; 3 taps
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_triton_matches_reference(B, lens, C, W, dtype):
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if len(lens) > 1 else None
    gen = torch.Generator().manual_seed(T + C)
    x = torch.randn(B, T, C, generator=gen).to(dtype)
    w = torch.randn(C, 1, W, generator=gen) * 0.5  # fp32, as the model keeps it
    check_short_conv(x, w, None, cu, seed=T)


@pytest.mark.parametrize("T", [1, 2, 45])  # a decode step, fewer tokens than the context, a prefill chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_triton_with_a_cached_left_context_matches_reference(T, dtype):
    B, C, W = 3, 160, 4
    gen = torch.Generator().manual_seed(T)
    x, left = torch.randn(B, T, C, generator=gen).to(dtype), torch.randn(B, W - 1, C, generator=gen).to(dtype)
    check_short_conv(x, torch.randn(C, 1, W, generator=gen) * 0.5, left, None, seed=T)


@pytest.mark.parametrize("W", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_decode_step_is_one_kernel_and_matches_reference(W, dtype):
    """A decode step (one token, a cached left context, no autograd): y and the next left context from
    `short_conv_decode_kernel`, 11 sequences over two programs, C not a multiple of the block."""
    B, C = 11, 160
    gen = torch.Generator().manual_seed(W)
    x, left = torch.randn(B, 1, C, generator=gen).to(dtype), torch.randn(B, W - 1, C, generator=gen).to(dtype)
    w = torch.randn(C, 1, W, generator=gen) * 0.5
    launched = []
    kernel = triton_short_conv.short_conv_decode_kernel
    with torch.no_grad(), gpu_like_bf16():
        triton_short_conv.short_conv_decode_kernel = _Spy(kernel, launched)
        try:
            y, tail = short_conv(x, w, left, None, backend="triton")
        finally:
            triton_short_conv.short_conv_decode_kernel = kernel
        y_ref, tail_ref = short_conv_reference(x, w, left, None)
    assert len(launched) == 1
    assert_close(y, y_ref, "y", 1e-5 if dtype == torch.float32 else BF16_ULP)
    assert torch.equal(tail, tail_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_triton_with_a_window_a_document_matches_reference(dtype):
    """Packed documents, each with its own left window [N, W-1, C] (a branch forked from a shared prefix),
    1- and 2-token documents among them: y, dx, dweight and the windows' gradient against the reference."""
    lens, C, W = [2, 40, 1, 9], 160, 4
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    gen = torch.Generator().manual_seed(5)
    x, left = torch.randn(1, T, C, generator=gen).to(dtype), torch.randn(len(lens), W - 1, C, generator=gen).to(dtype)
    w = torch.randn(C, 1, W, generator=gen) * 0.5
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    with gpu_like_bf16():
        y1, (dx1, dw1, dl1) = grads(lambda a, b, c: short_conv(a, b, c, cu, backend="triton"), [x, w, left], dy,
                                    wrt=(0, 1, 2))
        tail = short_conv(x, w, left, cu, backend="triton")[1]
    y2, (dx2, dw2, dl2) = grads(lambda a, b, c: short_conv_reference(a, b, c, cu), [x, w, left], dy, wrt=(0, 1, 2))
    rel = 1e-5 if dtype == torch.float32 else BF16_ULP
    assert_close(y1, y2, "y", rel)
    assert_close(dx1, dx2, "dx", rel)
    assert_close(dw1, dw2, "dweight", 1e-4)
    assert_close(dl1, dl2, "dleft", 1e-4 if dtype == torch.float32 else 2 * BF16_ULP)
    assert torch.equal(tail, short_conv_reference(x, w, left, cu)[1])


class _Spy:
    """A kernel that records its launches (grid) and runs."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def test_short_conv_document_reset_needs_no_host_sync():
    """Token positions in their documents come from cu_seqlens by tensor ops (no .tolist())."""
    cu = torch.tensor([0, 1, 4, 4, 9])
    assert triton_short_conv.positions_in_documents(cu, 9).tolist() == [0, 0, 1, 2, 0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "shape, dtype, out_dtype",
    [
        ((2, 70, 3, 128), torch.float32, torch.float32),
        ((1, 150, 2, 96), torch.bfloat16, torch.bfloat16),  # D not a power of two
        ((1, 40, 4, 64), torch.float32, torch.bfloat16),  # fp32 kernel output, bf16 o_proj (the model in fp32 o)
    ],
)
def test_output_norm_gate_triton_matches_reference(shape, dtype, out_dtype, monkeypatch):
    monkeypatch.setattr(triton_output_gate, "MAX_PROGRAMS", 3)  # several row blocks per backward program
    gen = torch.Generator().manual_seed(shape[1])
    o = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    g = (torch.randn(*shape, generator=gen) * 2).to(dtype)
    w = torch.rand(shape[-1], generator=gen) + 0.5
    dy = torch.randn(*shape, generator=gen).to(out_dtype)
    with gpu_like_bf16():
        y1, d1 = grads(lambda *a: output_norm_gate(*a, 1e-5, out_dtype, backend="triton"), [o, g, w], dy, (0, 1, 2))
    y2, d2 = grads(lambda *a: output_norm_gate_reference(*a, 1e-5, out_dtype), [o, g, w], dy, (0, 1, 2))
    bf16 = torch.bfloat16 in (dtype, out_dtype)
    assert_close(y1, y2, "y", BF16_ULP if out_dtype == torch.bfloat16 else 1e-5)
    for name, a, b in zip(("do", "dg"), d1, d2, strict=False):
        assert_close(a, b, name, BF16_ULP if dtype == torch.bfloat16 else (1e-4 if bf16 else 1e-5))
    assert_close(d1[2], d2[2], "dweight", 1e-4)


def test_kda_mixer_triton_islands_match_torch_path():
    """The KDA mixer with kernel_backend 'triton' (both islands and the chunk kernel) against 'torch',
    packed documents, forward and every parameter's gradient."""
    c = K3Config.preset("k3-tiny")
    c.linear_attn_config.chunk_size = 64  # the Triton chunk kernel's
    torch.manual_seed(0)
    layer = KimiDeltaAttention(c, 0)
    for p in layer.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, 0.2)
    x = torch.randn(1, 70, c.hidden_size)
    cu = torch.tensor([0, 1, 33, 70])
    dy = torch.randn(1, 70, c.hidden_size)
    runs = {}
    for backend in ("torch", "triton"):
        layer.backend = backend
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        y = layer(xx, cu_seqlens=cu)
        y.backward(dy)
        runs[backend] = [y, xx.grad] + [p.grad.clone() for p in layer.parameters()]
    names = ["y", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, runs["triton"], runs["torch"], strict=True):
        assert_close(a, b, name, 1e-3)
    # prefill then two decode steps (the conv cache's left context, the recurrent kernel)
    with torch.no_grad():
        steps = {}
        for backend in ("torch", "triton"):
            layer.backend = backend
            cache = layer.new_cache(2, torch.float32, "cpu")
            xs = torch.randn(2, 9, c.hidden_size, generator=torch.Generator().manual_seed(1))
            steps[backend] = [layer(xs[:, :7], cache=cache), layer(xs[:, 7:8], cache=cache)]
            steps[backend] += [layer(xs[:, 8:], cache=cache), cache.conv, cache.state]
    for i, (a, b) in enumerate(zip(steps["triton"], steps["torch"], strict=True)):
        assert_close(a, b, f"decode output {i}", 1e-3)
