"""The Triton flash attention (kernels/attention/triton_flash.py) on the CPU under TRITON_INTERPRET=1: output
and every gradient against the fp32 reference, on packed documents of ragged lengths (a partial last block,
a document longer than a block, one of a single token), with and without a prefix every document shares,
MLA's NoPE head dims (q/k 192 = padded to 256, v 128; scaled down: 24/16) and a power-of-two case.

Run by test_flash_attention.py in one process with the other case files (interpreter_run.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from interpret_cases import gpu_like_bf16  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.attention import (  # noqa: E402
    causal_attention_reference,
    shared_prefix_attention,
    triton_flash,  # noqa: E402
)

pytestmark = pytest.mark.skipif(
    not isinstance(triton_flash.flash_fwd_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)


def _inputs(lengths, P, H, D, DV, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.randn(T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(T, H, DV, generator=gen)
    kp, vp = torch.randn(P, H, D, generator=gen), torch.randn(P, H, DV, generator=gen)
    do = torch.randn(T, H, DV, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(dtype) for x in (q, k, v, kp, vp)], do, cu


def _reference(q, k, v, kp, vp, cu, scale):
    """fp32 truth: the packed reference, or with a prefix the whole [prefix ; document] per document."""
    q, k, v, kp, vp = (x.float() for x in (q, k, v, kp, vp))
    if kp.shape[0] == 0:
        return causal_attention_reference(q[None], k[None], v[None], scale, cu_seqlens=cu)[0]
    return shared_prefix_attention(q[None], k[None], v[None], kp[None], vp[None], scale, cu, backend="torch")[0]


def _grads(fn, tensors, do):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    o = fn(*leaves)
    o.backward(do.to(o.dtype))
    return o.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("lengths, P", [([70, 1, 33], 0), ([70, 1, 33], 45), ([16], 64), ([5, 129], 3)])
@pytest.mark.parametrize("D, DV", [(24, 16), (16, 16)])
def test_flash_attention_fp32_equals_the_reference(lengths, P, D, DV):
    H, scale = 2, D**-0.5
    (q, k, v, kp, vp), do, cu = _inputs(lengths, P, H, D, DV, torch.float32, seed=len(lengths) + P)

    def ours(q, k, v, kp, vp):
        return triton_flash.flash_attention(q, k, v, scale, cu, cu.tolist(), *((kp, vp) if P else (None, None)))

    o, grads = _grads(ours, (q, k, v, kp, vp), do)
    o_ref, grads_ref = _grads(lambda *t: _reference(*t, cu, scale), (q, k, v, kp, vp), do)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dk_prefix", "dv_prefix"), grads, grads_ref, strict=True):
        if not P and name.endswith("prefix"):
            assert g is None
            continue
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4, msg=name)
        assert g.abs().max() > 0, name


def test_flash_attention_bf16_is_within_bf16_tolerance_of_the_fp32_truth():
    """bf16 inputs (the learner's autocast): products on bf16 tensor-core inputs with fp32 accumulation,
    fp32 softmax and output; against the fp32 reference of the same bf16 values, the error is bf16's."""
    lengths, P, H, D, DV = [70, 1, 33], 45, 2, 24, 16
    (q, k, v, kp, vp), do, cu = _inputs(lengths, P, H, D, DV, torch.bfloat16, seed=3)
    scale = D**-0.5
    with gpu_like_bf16():
        o, grads = _grads(lambda *t: triton_flash.flash_attention(*t[:3], scale, cu, cu.tolist(), *t[3:]),
                          (q, k, v, kp, vp), do)
    o_ref, grads_ref = _grads(lambda *t: _reference(*t, cu, scale), [x.float() for x in (q, k, v, kp, vp)], do)
    assert o.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        rel = (g.float() - g_ref).norm() / g_ref.norm()
        assert rel < 2e-2, rel


def test_the_dispatchers_and_the_mla_layer_run_the_kernel_when_asked():
    """causal_attention and shared_prefix_attention on the Triton path with kernel='flash' ([1, T, ...] in,
    fp32 out), and Gated MLA built with attention_kernel 'flash': the same values and gradients as on the
    reference path; an unknown kernel name is refused naming the setting."""
    from k3rl.kernels.attention import causal_attention
    from k3rl.model import K3Config
    from k3rl.model.mla import GatedMLA

    (q, k, v, kp, vp), do, cu = _inputs([40, 9, 30], 20, 2, 24, 16, torch.float32, seed=7)
    one = lambda x: x[None]  # noqa: E731
    flash = causal_attention(one(q), one(k), one(v), 0.2, cu_seqlens=cu, backend="triton", kernel="flash")
    torch.testing.assert_close(flash, causal_attention(one(q), one(k), one(v), 0.2, cu_seqlens=cu, backend="torch"),
                               rtol=1e-5, atol=1e-5)
    shared = shared_prefix_attention(one(q), one(k), one(v), one(kp), one(vp), 0.2, cu, backend="triton", kernel="flash")
    torch.testing.assert_close(shared, shared_prefix_attention(one(q), one(k), one(v), one(kp), one(vp), 0.2, cu,
                                                               backend="torch"), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"attention kernel must be one of \('sdpa', 'flash'\) "
                                         r"\(model.overrides.attention_kernel\), got 'fa3'"):
        causal_attention(one(q), one(k), one(v), 0.2, cu_seqlens=cu, kernel="fa3")

    cfg = K3Config.preset("k3-tiny")
    torch.manual_seed(0)
    ours = GatedMLA(cfg.model_copy(update={"kernel_backend": "triton", "attention_kernel": "flash"}), 3)
    ref = GatedMLA(cfg.model_copy(update={"kernel_backend": "torch"}), 3)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(1, 79, cfg.hidden_size)
    outs = []
    for layer in (ours, ref):
        xi = x.clone().requires_grad_()
        y = layer(xi, cu_seqlens=cu)
        y.square().sum().backward()
        outs.append((y, xi.grad, layer.kv_b_proj.weight.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
