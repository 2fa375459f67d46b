"""The Block AttnRes aggregation kernel on the CPU under TRITON_INTERPRET=1: forward and every gradient
(each source, the query's two parameters) against the PyTorch reference, fp32 and bf16 sources.

Run by test_attnres_kernel.py in a fresh process (TRITON_INTERPRET=1 must be set before triton is
imported). bf16 runs inside interpret_cases.gpu_like_bf16 (the interpreter's bf16 casts as the GPU's).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.attnres import attnres_aggregate, attnres_aggregate_reference, triton_aggregate  # noqa: E402
from k3rl.model import K3Config, K3ForCausalLM  # noqa: E402
from k3rl.model import model as model_module  # noqa: E402
from k3rl.model.attnres import aggregate, make_query_params, query_vector  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(triton_aggregate.aggregate_fwd_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)

BF16_ULP = 2.0**-7  # a bf16 value's rounding, relative, with a rounding-order difference on either side


def assert_close(a, b, what, rel):
    """|a - b| <= rel |b| + 1e-5 max |b|: rounding of each value (rel) plus fp32 rounding at the tensor's
    scale (sums of terms that cancel)."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
    err = (a.float() - b.float()).abs()
    bound = rel * b.float().abs() + 1e-5 * b.float().abs().max()
    assert bool((err <= bound).all()), (
        f"{what}: max error {err.max().item()}, largest value {b.abs().max().item()}"
    )


def case(S, shape, dtype, seed):
    """S sources of unequal scales (so the rms factors matter), a query's parameters giving logits of
    a few units (a softmax far from uniform), and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    scales = torch.rand(S, generator=gen) * 3 + 0.3
    sources = [(torch.randn(*shape, generator=gen) * scales[i]).to(dtype) for i in range(S)]
    proj, norm = make_query_params(d, 1e-6)
    with torch.no_grad():
        proj.weight.normal_(0.0, 2.0 / d**0.5, generator=gen)
        norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    dh = torch.randn(*shape, generator=gen).to(dtype)
    return sources, proj, norm, dh


def run(fn, sources, proj, norm, dh):
    """h and the gradients of every source, the pseudo-query projection and the norm weight."""
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    proj.zero_grad(), norm.zero_grad()
    h = fn(leaves, query_vector(proj, norm))
    h.backward(dh)
    return h, [s.grad for s in leaves], proj.weight.grad.clone(), norm.weight.grad.clone()


@pytest.mark.parametrize("S", [2, 3, 5])
@pytest.mark.parametrize("d, shape", [(64, (1, 37)), (96, (2, 19)), (256, (3, 7))])  # ragged row counts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_aggregate_triton_matches_reference(S, d, shape, dtype, monkeypatch):
    monkeypatch.setattr(triton_aggregate, "ROWS", 256)  # several rows per block, a partial last block,
    monkeypatch.setattr(triton_aggregate, "MAX_PROGRAMS", 3)  # several row blocks per backward program
    sources, proj, norm, dh = case(S, (*shape, d), dtype, seed=S * d)
    with gpu_like_bf16():
        h1, dv1, dw1, dg1 = run(
            lambda v, q: attnres_aggregate(v, q, 1e-6, backend="triton"), sources, proj, norm, dh
        )
    h2, dv2, dw2, dg2 = run(lambda v, q: attnres_aggregate_reference(v, q, 1e-6), sources, proj, norm, dh)
    rel = 1e-5 if dtype == torch.float32 else BF16_ULP
    assert_close(h1, h2, "h", rel)
    for i, (a, b) in enumerate(zip(dv1, dv2, strict=True)):
        assert_close(a, b, f"d source {i}", rel)
    assert_close(dw1, dw2, "d res_proj.weight", 1e-4)  # fp32 sums over the tokens, in another order
    assert_close(dg1, dg2, "d res_norm.weight", 1e-4)


def test_one_row_per_program_at_the_default_launch_settings():
    """The launch the model gets at K3 width (one row per program) on a d that is no power of two."""
    assert triton_aggregate.launch_settings(7168) == (8192, 1, 16)
    sources, proj, norm, dh = case(4, (1, 5, 7168), torch.bfloat16, seed=1)
    with gpu_like_bf16():
        ours = run(lambda v, q: attnres_aggregate(v, q, 1e-6, backend="triton"), sources, proj, norm, dh)
    ref = run(lambda v, q: attnres_aggregate_reference(v, q, 1e-6), sources, proj, norm, dh)
    assert_close(ours[0], ref[0], "h", BF16_ULP)
    for i, (a, b) in enumerate(zip(ours[1], ref[1], strict=True)):
        assert_close(a, b, f"d source {i}", BF16_ULP)
    assert_close(ours[2], ref[2], "d res_proj.weight", 1e-4)
    assert_close(ours[3], ref[3], "d res_norm.weight", 1e-4)


@pytest.mark.parametrize("first", [torch.float32, torch.bfloat16], ids=["fp32-first", "bf16-first"])
def test_sources_of_mixed_dtypes_as_under_autocast(first):
    """Under bf16 autocast the embeddings' block is fp32 and the layers' outputs bf16: the kernel takes
    them as they are and widens each to fp32 as it reads it (as the reference does), h comes back in the first source's dtype and each
    source's gradient in its own."""
    sources, proj, norm, dh = case(3, (2, 11, 96), torch.float32, seed=7)
    sources = [sources[0].to(first)] + [v.bfloat16() for v in sources[1:]]
    dh = dh.to(first)
    with gpu_like_bf16():
        ours = run(lambda v, q: attnres_aggregate(v, q, 1e-6, backend="triton"), sources, proj, norm, dh)
    ref = run(lambda v, q: attnres_aggregate_reference(v, q, 1e-6), sources, proj, norm, dh)
    assert ours[0].dtype == first
    assert_close(ours[0], ref[0], "h", 1e-5 if first == torch.float32 else BF16_ULP)
    for i, (a, b) in enumerate(zip(ours[1], ref[1], strict=True)):
        assert a.dtype == sources[i].dtype
        assert_close(a, b, f"d source {i}", 1e-5 if sources[i].dtype == torch.float32 else BF16_ULP)
    assert_close(ours[2], ref[2], "d res_proj.weight", 1e-4)
    assert_close(ours[3], ref[3], "d res_norm.weight", 1e-4)


def test_model_with_the_kernel_matches_the_reference_path(monkeypatch):
    """k3-tiny (8 layers, blocks of 3: 1 to 4 sources) with every aggregation by the kernel against the
    reference: logits and every parameter's gradient, the pseudo-queries' included."""
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.3)
    ids = torch.randint(0, 256, (2, 9))
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setattr(
            model_module, "aggregate", lambda s, q, eps, _layer_backend=None, b=backend: aggregate(s, q, eps, backend=b)
        )
        model.zero_grad()
        logits = model(ids)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        runs[backend] = [logits] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    names = ["logits"] + [n for n, p in model.named_parameters() if p.grad is not None]
    assert any("res_proj" in n for n in names) and any("res_norm" in n for n in names)
    # fp32 sums in another order, carried through 8 layers: a bound at each tensor's scale. The reference
    # path run twice agrees bit for bit; kernel against reference, the worst tensors were within 1e-4 on one
    # machine and 1.2e-4 to 1.9e-4 (4 gradients, A_log's the largest) on another (the CPU's reductions
    # round differently); a wrong kernel errs at the scale of the tensor itself
    for name, a, b in zip(names, runs["triton"], runs["torch"], strict=True):
        assert (a - b).abs().max() <= 5e-4 * b.abs().max(), f"{name}: max error {(a - b).abs().max().item()}"
