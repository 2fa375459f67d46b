"""The Block AttnRes aggregation kernel: under the interpreter (in a fresh process: attnres_interpret_cases.py),
compiled for sm_90 (attnres_sm90_check.py), the dispatcher's choices and errors, the benchmark's lever, and
the kernel on a GPU."""

import importlib.util
import pathlib

import pytest
import torch
from interpreter_run import run_interpreted, run_sm90_check

from k3rl.kernels.attnres import attnres_aggregate, attnres_aggregate_reference
from k3rl.model.attnres import aggregate

HERE = pathlib.Path(__file__).parent
has_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@has_triton
@pytest.mark.slow
@pytest.mark.interpreter_cases("attnres_interpret_cases.py")
def test_aggregate_kernel_under_the_interpreter():
    run_interpreted("attnres_interpret_cases.py")


@pytest.mark.slow
@has_triton
def test_aggregate_kernels_compile_for_sm90():
    """The compiler (not the interpreter) takes both kernels at K3 width with the model's launch settings,
    the tuple of source pointers included (also of mixed dtypes, as under autocast); neither needs more shared memory than a Hopper block has."""
    shared = run_sm90_check("attnres_sm90_check.py", timeout=900)
    assert len(shared) == 8 and all(n <= 232448 for n in shared.values()), shared


def test_aggregate_on_the_cpu_is_the_reference_and_one_source_is_the_identity():
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 5, 16, generator=gen) * s for s in (0.5, 1.0, 4.0)]
    query = torch.randn(16, generator=gen)
    h = aggregate(sources, query, 1e-6)
    assert torch.equal(h, attnres_aggregate_reference(sources, query, 1e-6))
    # the formula, written out: softmax over the rms-normalised logits, weights on the raw sources
    v = torch.stack(sources)
    a = torch.softmax((v / v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * query).sum(-1), 0)
    assert torch.allclose(h, (a[..., None] * v).sum(0), atol=1e-6)
    assert aggregate(sources[:1], query, 1e-6) is sources[0]
    bf16 = [s.bfloat16() for s in sources]
    assert aggregate(bf16, query, 1e-6).dtype == torch.bfloat16


def test_aggregate_refuses_mismatched_sources_query_and_backend():
    v, q = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(ValueError, match="at least one source"):
        attnres_aggregate([], q, 1e-6)
    with pytest.raises(
        ValueError, match="share one shape and device; got \\(3, 8\\) torch.float32 cpu, \\(3, 4\\)"
    ):
        attnres_aggregate([v, v[:, :4]], q, 1e-6)
    # mixed dtypes (autocast: an fp32 embedding block beside bf16 layer outputs) are the reference's case
    mixed = attnres_aggregate([v, v.bfloat16() * 2], q, 1e-6)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, attnres_aggregate_reference([v, v.bfloat16() * 2], q, 1e-6))
    with pytest.raises(ValueError, match=r"query must be \[d\] = \[8\]"):
        attnres_aggregate([v, v], torch.randn(1, 8), 1e-6)
    with pytest.raises(ValueError, match="backend must be one of"):
        attnres_aggregate([v, v], q, 1e-6, backend="cuda")


def test_layer_benchmark_lever_runs_the_layer_on_the_reference():
    """benchmarks/layer.py's 'attnres torch' row (the before of the fused kernel): it swaps the decoder
    layer's aggregations for the reference, the layer still runs forward and backward, undo restores."""
    from k3rl.model import K3Config
    from k3rl.model import model as model_module

    spec = importlib.util.spec_from_file_location(
        "layer_benchmark", HERE.parents[1] / "benchmarks" / "layer.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert all("attnres torch" in dict(bench.levers(kind, 0)) for kind in ("kda_moe", "mla_moe"))
    c = K3Config.preset("k3-tiny")
    torch.manual_seed(0)
    layer = model_module.K3ForCausalLM(c).model.layers[4]  # blocks of 3: a bank of two blocks, three sources
    with torch.no_grad():
        layer.self_attention_res_proj.weight.normal_()
        layer.mlp_res_proj.weight.normal_()
    xs = [torch.randn(1, 6, c.hidden_size, requires_grad=True) for _ in range(3)]
    before = layer(xs[:2], xs[2])[1]
    undo = dict(bench.levers("kda_moe", 0))["attnres torch"](layer)
    try:
        assert model_module.aggregate is not aggregate
        after = layer(xs[:2], xs[2])[1]
        after.sum().backward()
    finally:
        undo()
    assert model_module.aggregate is aggregate
    assert torch.equal(before, after) and all(x.grad is not None for x in xs)
    assert layer.self_attention_res_proj.weight.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_aggregate_triton_on_the_gpu_matches_the_reference_bf16():
    """K3 width, four bf16 sources (layer 25's), 4087 tokens: h and every gradient within bf16 rounding of
    the reference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, d = 4087, 7168
    sources = [
        torch.randn(T, d, device="cuda", generator=gen).mul(s).bfloat16() for s in (0.3, 1.0, 2.0, 5.0)
    ]
    w = torch.randn(d, device="cuda", generator=gen) * 2 / d**0.5
    gamma = torch.rand(d, device="cuda", generator=gen) + 0.5
    dh = torch.randn(T, d, device="cuda", generator=gen).bfloat16()
    runs = []
    for backend in ("triton", "torch"):
        leaves = [s.clone().requires_grad_() for s in sources] + [
            w.clone().requires_grad_(),
            gamma.clone().requires_grad_(),
        ]
        h = attnres_aggregate(leaves[:4], leaves[5] * leaves[4], 1e-6, backend=backend)
        h.backward(dh)
        runs.append([h] + [t.grad for t in leaves])
    names = ["h"] + [f"d source {i}" for i in range(4)] + ["d w", "d gamma"]
    for name, a, b in zip(names, *runs, strict=True):
        assert a.dtype == b.dtype, name
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 4e-3, name
