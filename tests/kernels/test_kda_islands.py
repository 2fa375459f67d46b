"""The KDA islands (short convolution, output norm + gate): the Triton kernels under the interpreter (in a
fresh process: islands_interpret_cases.py) and compiled for sm_90 (islands_sm90_check.py), the dispatchers'
choices and errors, and the kernels on a GPU."""

import importlib.util
import pathlib

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

from k3rl.kernels.kda import output_norm_gate, output_norm_gate_reference, short_conv, short_conv_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.slow
@pytest.mark.interpreter_cases("islands_interpret_cases.py")
def test_island_kernels_under_the_interpreter():
    run_interpreted("islands_interpret_cases.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_island_kernels_compile_for_sm90():
    """The compiler (not the interpreter) takes every island kernel with its launch settings; none
    needs more shared memory than a Hopper block has."""
    shared = run_sm90_check("islands_sm90_check.py")
    assert len(shared) == 10 and all(n <= 232448 for n in shared.values()), shared


def test_short_conv_on_cpu_is_the_reference_and_keeps_the_decode_cache():
    gen = torch.Generator().manual_seed(0)
    x, w, left = torch.randn(2, 5, 8, generator=gen), torch.randn(8, 1, 4, generator=gen), torch.randn(2, 3, 8)
    y, tail = short_conv(x, w, left, None)
    y_ref, tail_ref = short_conv_reference(x, w, left, None)
    assert torch.equal(y, y_ref) and torch.equal(tail, x[:, 2:]) and torch.equal(tail_ref, tail)
    # a short input: the new left context is the old one's end and the input
    _, tail = short_conv(x[:, :1], w, left, None)
    assert torch.equal(tail, torch.cat([left[:, 1:], x[:, :1]], 1))


def test_short_conv_window_a_document_is_a_prefix_run_once():
    """A left window per document (cu_seqlens, [N, W-1, C]): each document's output and new window equal
    the conv over [prefix ; document] (the prefix's rows as the window), and the window's gradient is
    what those prefix rows get there (fp32, autograd)."""
    gen = torch.Generator().manual_seed(1)
    C, W, lens = 6, 4, [5, 1, 2]  # 1- and 2-token documents: the window reaches past their end
    x, w = torch.randn(1, sum(lens), C, generator=gen), torch.randn(C, 1, W, generator=gen)
    pre = torch.randn(len(lens), 7, C, generator=gen)  # each document's prefix (its last W-1 rows: the window)
    cu = torch.tensor([0, 5, 6, 8])
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    left = pre[:, -(W - 1) :].clone().requires_grad_()
    y, tail = short_conv(xl, wl, left, cu)
    dy = torch.randn(y.shape, generator=gen)
    (y * dy).sum().backward()
    dw = torch.zeros_like(w)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        xs, ws = torch.cat([pre[n : n + 1], x[:, a:b]], 1).requires_grad_(), w.clone().requires_grad_()
        ys, tail_s = short_conv_reference(xs, ws)
        (ys[:, 7:] * dy[:, a:b]).sum().backward()
        assert torch.allclose(y[:, a:b], ys[:, 7:], atol=1e-6) and torch.equal(tail[n], tail_s[0])
        assert torch.allclose(xl.grad[:, a:b], xs.grad[:, 7:], atol=1e-6)
        assert torch.allclose(left.grad[n], xs.grad[0, 7 - (W - 1) : 7], atol=1e-6)
        dw += ws.grad
    assert torch.allclose(wl.grad, dw, atol=1e-5)


def test_islands_refuse_bad_shapes_and_backends():
    x, w = torch.randn(1, 5, 8), torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match=r"weight \[C, 1, W\]"):
        short_conv(x, torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        short_conv(x, w, None, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match=r"left must be \[B, W-1, C\] = \(1, 3, 8\)"):
        short_conv(x, w, torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match=r"left must be \[N, W-1, C\] \(one window a document of cu_seqlens\) = \(2, 3, 8\)"):
        short_conv(x, w, torch.zeros(1, 3, 8), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="backend must be one of"):
        short_conv(x, w, backend="cuda")
    o = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="o and g must have one shape"):
        output_norm_gate(o, o[..., :4], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        output_norm_gate(o, o, torch.ones(4), 1e-5)


def gpu_case(seed=0, lens=(1, 700, 1, 1300, 37, 2048)):
    """Ragged documents (1-token ones included) of 4087 tokens, and a random-tensor maker."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    T = int(cu[-1])
    return cu, T, r


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def with_grads(fn, inputs, d_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(d_out)
    return [out] + [t.grad for t in leaves]


@pytest.mark.gpu
@cuda
def test_short_conv_triton_on_the_gpu_matches_the_reference_bf16():
    cu, T, r = gpu_case()
    x, w, dy = r(1, T, 1536).bfloat16(), r(1536, 1, 4) * 0.5, r(1, T, 1536).bfloat16()
    ours = with_grads(lambda a, b: short_conv(a, b, None, cu, backend="triton"), [x, w], dy)
    ref = with_grads(lambda a, b: short_conv_reference(a, b, None, cu), [x, w], dy)
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.float32
    for name, a, b in zip(("y", "dx", "dweight"), ours, ref, strict=True):
        assert rel(a, b) < 4e-3, name  # bf16 rounding of the same fp32 values


@pytest.mark.gpu
@cuda
def test_output_norm_gate_triton_on_the_gpu_matches_the_reference_bf16():
    cu, T, r = gpu_case()
    o, g, w = r(1, T, 12, 128).bfloat16(), r(1, T, 12, 128).bfloat16(), r(128) * 0.2 + 1
    dy = r(1, T, 12, 128).bfloat16()
    ours = with_grads(lambda *a: output_norm_gate(*a, 1e-5, torch.bfloat16, backend="triton"), [o, g, w], dy)
    ref = with_grads(lambda *a: output_norm_gate_reference(*a, 1e-5, torch.bfloat16), [o, g, w], dy)
    for name, a, b in zip(("y", "do", "dg", "dweight"), ours, ref, strict=True):
        assert a.dtype == b.dtype and rel(a, b) < 4e-3, name


def test_layer_benchmark_lever_runs_the_mixer_on_the_references():
    """benchmarks/layer.py's 'kda islands torch' row (the before of the fused kernels): it swaps the mixer's
    two islands for their references, the mixer still runs forward and backward, and undo restores them."""
    import importlib.util as iu

    from k3rl.model import K3Config
    from k3rl.model import kda as kda_module

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "layer.py"
    spec = iu.spec_from_file_location("layer_benchmark", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = dict(bench.levers("kda", False))
    assert "eager" in rows and "kda islands torch" in rows and "kda islands torch" in dict(bench.levers("kda_moe", 0))
    layer = kda_module.KimiDeltaAttention(K3Config.preset("k3-tiny"), 0)
    x = torch.randn(1, 12, layer.q_proj.in_features, requires_grad=True)
    before = layer(x, cu_seqlens=torch.tensor([0, 5, 12]))
    undo = rows["kda islands torch"](layer)
    try:
        assert kda_module.short_conv is not short_conv and kda_module.output_norm_gate is not output_norm_gate
        after = layer(x, cu_seqlens=torch.tensor([0, 5, 12]))
        after.sum().backward()
    finally:
        undo()
    assert kda_module.short_conv is short_conv and kda_module.output_norm_gate is output_norm_gate
    assert torch.equal(before, after) and x.grad is not None
