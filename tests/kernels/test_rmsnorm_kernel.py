"""The fused RMSNorm kernel: under the interpreter (in a fresh process: rmsnorm_interpret_cases.py), the
dispatcher's choices and errors, the model's norms following its kernel backend, and the kernel on a GPU."""

import importlib.util

import pytest
import torch
from interpreter_run import run_interpreted

from k3rl.kernels.rmsnorm import rms_norm, rms_norm_reference
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.common import RMSNorm

has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
@has_triton
@pytest.mark.interpreter_cases("rmsnorm_interpret_cases.py")
def test_rms_norm_kernel_under_the_interpreter():
    run_interpreted("rmsnorm_interpret_cases.py")


def test_rms_norm_on_the_cpu_is_the_formula():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 16, generator=gen) * 3, torch.rand(16, generator=gen) + 0.5
    y = rms_norm(x, w, 1e-6)
    assert torch.equal(y, rms_norm_reference(x, w, 1e-6))
    torch.testing.assert_close(y, w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    # bf16 rows: n rounds to bf16 before gamma multiplies (the reference code's order), under autocast too
    xb = x.bfloat16()
    n = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(rms_norm(xb, w, 1e-6), w.bfloat16() * n)


def test_rms_norm_refuses_a_wrong_weight_and_backend():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[d\] = \[8\] \(x's last dim\); got \(4,\)"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="backend must be one of"):
        rms_norm(x, torch.ones(8), 1e-6, backend="cuda")
    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            rms_norm(x, torch.ones(8), 1e-6, backend="triton")


def test_every_norm_of_the_model_runs_its_kernel_backend():
    cfg = K3Config.preset("k3-tiny").model_copy(update={"kernel_backend": "torch"})
    norms = [m for m in K3ForCausalLM(cfg).modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 10 and {m.backend for m in norms} == {"torch"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rms_norm_kernel_on_the_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 7168, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.rand(7168, device="cuda", generator=gen) + 0.5).requires_grad_()
    dy = torch.randn(4096, 7168, device="cuda", generator=gen).bfloat16()
    y = rms_norm(x, w, 1e-6, backend="triton")
    y.backward(dy)
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    y2 = rms_norm_reference(x, w, 1e-6)
    y2.backward(dy)
    assert (y != y2).float().mean().item() < 0.01
    torch.testing.assert_close(y.float(), y2.float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(dx.float(), x.grad.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(dw, w.grad, rtol=1e-2, atol=1.0)


def test_layer_benchmark_lever_puts_the_norms_on_eager_pytorch():
    """benchmarks/layer.py's 'norms torch' row (the before of the fused kernel) sets every norm of the
    layer to the PyTorch path; the layer gives the same output, and undo restores the kernel's backend."""
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "layer_benchmark", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "layer.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert all("norms torch" in dict(bench.levers(kind, 0)) for kind in ("kda_moe", "mla_moe", "kda", "moe", "mla"))
    torch.manual_seed(0)
    c = K3Config.preset("k3-tiny")
    layer = K3ForCausalLM(c).model.layers[4]
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
    assert len(norms) >= 2 and {m.backend for m in norms} == {"auto"}
    xs = [torch.randn(1, 6, c.hidden_size) for _ in range(3)]
    before = layer(xs[:2], xs[2])[1]
    undo = dict(bench.levers("kda_moe", 0))["norms torch"](layer)
    try:
        assert {m.backend for m in norms} == {"torch"}
        assert torch.equal(layer(xs[:2], xs[2])[1], before)
    finally:
        undo()
    assert {m.backend for m in norms} == {"auto"}
