"""Triton kernels on the CPU under TRITON_INTERPRET=1, against the PyTorch references (fwd + bwd).

TRITON_INTERPRET=1 must be set before triton itself is imported (triton.language's own jit
helpers are built at import), so test_triton_interpret.py runs this file in a fresh process:
``TRITON_INTERPRET=1 python -m pytest tests/kernels/interpret_cases.py``.
"""

import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from k3rl.kernels.kda import (  # noqa: E402  # noqa: E402
    chunk_kda,
    chunk_kda_reference,
    fused_recurrent_kda,
    naive_recurrent_kda,
    triton_chunk,
    triton_recurrent,
)

pytestmark = pytest.mark.skipif(
    not isinstance(triton_chunk.intra_fwd_kernel, InterpretedFunction),
    reason="Triton kernels were imported before TRITON_INTERPRET=1; run this file in its own process",
)


def inputs(B, T, H, K, V, n_states, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), z=r(B, T, H, K), beta=torch.rand(B, T, H, generator=gen),
        S0=r(n_states, H, K, V), A_log=r(H) * 0.3, dt_bias=r(H * K) * 0.5,
    )  # fmt: skip


def run_with_grads(fn, x, gate_in_kernel, with_state, cu=None, **kw):
    names = (
        ["q", "k", "v", "z", "beta"]
        + (["S0"] if with_state else [])
        + (["A_log", "dt_bias"] if gate_in_kernel else [])
    )
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    g = leaves["z"] if gate_in_kernel else -5.0 * torch.sigmoid(leaves["z"])  # raw g needs g >= -5
    o, s = fn(
        leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"],
        initial_state=leaves.get("S0"), output_final_state=with_state, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel,
        A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"), **kw,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(99)
    loss = (o * torch.randn(o.shape, generator=gen)).sum()
    if s is not None:
        loss = loss + (s * torch.randn(s.shape, generator=gen)).sum()
    loss.backward()
    return o, s, {n: t.grad for n, t in leaves.items()}


def assert_close(a, b, tol, what):
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), f"{what}: max error {err}"


@pytest.mark.parametrize(
    "B, lens, K, V, gate_in_kernel, with_state",
    [
        (1, [40, 1, 109], 16, 32, True, True),  # ragged documents, lengths not multiples of 64
        (2, [70], 128, 16, False, False),  # padded batch of two, raw log-decay, no state, K split in two
    ],
)
def test_chunk_kda_triton_matches_reference_fwd_bwd(B, lens, K, V, gate_in_kernel, with_state):
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if len(lens) > 1 else None
    x = inputs(B, T, 2, K, V, len(lens) if cu is not None else B, seed=T)
    o1, s1, g1 = run_with_grads(chunk_kda, x, gate_in_kernel, with_state, cu, backend="triton")
    o2, s2, g2 = run_with_grads(chunk_kda_reference, x, gate_in_kernel, with_state, cu)
    assert_close(o1, o2, 1e-4, "o")
    if with_state:
        assert_close(s1, s2, 1e-4, "final state")
    for name in g2:
        assert_close(g1[name], g2[name], 1e-4, f"d{name}")


def forked(fn, x, P, cu, **kw):
    """A prefix of P tokens run once, its final state the initial state of every branch (the documents of
    cu after it): outputs [o_prefix ; o_branches] and every input's gradient, the prefix's summed over the
    branches through the final state."""
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias")}
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=leaves["A_log"],
                dt_bias=leaves["dt_bias"], **kw)  # fmt: skip
    part = lambda a, b: [leaves[n][:, a:b] for n in ("q", "k", "v", "z", "beta")]  # noqa: E731
    o_p, S_p = fn(*part(0, P), output_final_state=True, **gate)
    S0 = S_p.expand(cu.numel() - 1, -1, -1, -1)
    o_b, _ = fn(*part(P, None), initial_state=S0, cu_seqlens=cu, **gate)
    o = torch.cat([o_p, o_b], 1)
    (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    return o, {n: t.grad for n, t in leaves.items()}


def test_chunk_kda_triton_forked_prefix_state_matches_reference():
    """Shared-prefix training's fork: a prefix of one chunk plus 6 tokens, three branches (1, 9 and 70
    tokens) starting from its final state; outputs and every gradient against the reference's fork."""
    P, lens = 70, [1, 9, 70]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = inputs(1, P + sum(lens), 2, 16, 16, 1, seed=4)
    o1, g1 = forked(chunk_kda, x, P, cu, backend="triton")
    o2, g2 = forked(chunk_kda_reference, x, P, cu)
    assert_close(o1, o2, 1e-4, "o")
    for name in g2:
        assert_close(g1[name], g2[name], 1e-4, f"d{name}")


def strong_gates(x, H, K, seed):
    """The gate as K3 trains it hard: A_log = log U(1, 16), dt_bias ~ 0.5 N(0, 1) (fast decay, many
    saturated gates), in place of inputs()'s mild one."""
    gen = torch.Generator().manual_seed(seed)
    x["A_log"] = torch.empty(H).uniform_(1, 16, generator=gen).log()
    x["dt_bias"] = torch.randn(H * K, generator=gen) * 0.5
    return x


def test_chunk_kda_triton_strong_gates_gate_logit_gradient_fp32():
    """fp32, strong gates, ragged documents, an initial state: every gradient, the gate logit z's and
    A_log's and dt_bias's included, matches the reference to the tolerance of the other tests."""
    lens, H, K, V = [40, 1, 150], 2, 32, 32
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = strong_gates(inputs(1, T, H, K, V, len(lens), seed=11), H, K, seed=11)
    o1, s1, g1 = run_with_grads(chunk_kda, x, True, True, cu, backend="triton")
    o2, s2, g2 = run_with_grads(chunk_kda_reference, x, True, True, cu)
    assert_close(o1, o2, 1e-4, "o")
    assert_close(s1, s2, 1e-4, "final state")
    for name in g2:
        assert_close(g1[name], g2[name], 1e-4, f"d{name}")


def _bf16_bits_as_fp32(h):
    return (h.data.astype(np.uint32) << 16).view(np.float32)


def _round_tf32(a):
    """fp32 -> the 10-bit mantissa tensor cores read for a TF32 product (round half away from zero)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(1 << 12)) & np.uint32(0xFFFFE000)).view(np.float32)


@contextlib.contextmanager
def gpu_like_bf16():
    """The interpreter computing bf16 (and TF32) as an NVIDIA GPU does. Triton's interpreter keeps bf16 as
    its raw 16 bits: its tl.dot multiplies those bits as integers and its fp32 -> bf16 cast truncates. Here
    bf16 dot operands are widened to fp32 and summed in fp32 (the GPU's bf16 MMA), fp32 -> bf16 rounds to
    nearest even (cvt.rn.bf16), and fp32 dots at the default input precision read TF32 operands."""
    B = interpreter.InterpreterBuilder
    saved = B.create_dot, B.cast_impl, B.create_fp_trunc, B.create_fp_ext

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a_, b_ = _bf16_bits_as_fp32(a), _bf16_bits_as_fp32(b)
        elif a.dtype.scalar == tl.float32 and "TF32" in str(input_precision).upper():
            a_, b_ = _round_tf32(a.data), _round_tf32(b.data)
        else:
            return saved[0](self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(np.matmul(a_, b_, dtype=np.float32) + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and d == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(x.view(torch.int16).numpy().view(np.uint16), d)
        if s == tl.bfloat16 and d == tl.float32:
            return interpreter.TensorHandle(_bf16_bits_as_fp32(src), d)
        return saved[1](self, src, dst_type)

    B.create_dot, B.cast_impl = create_dot, cast_impl
    B.create_fp_trunc = B.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    try:
        yield
    finally:
        B.create_dot, B.cast_impl, B.create_fp_trunc, B.create_fp_ext = saved


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_gpu_like_bf16_dot_and_rounding():
    """The emulation itself: a bf16 product equals the fp32 product of the bf16 values, and the cast rounds."""

    @triton.jit
    def product(a, b, c, N: tl.constexpr):
        r = tl.arange(0, N)
        off = r[:, None] * N + r[None, :]
        prod = tl.dot(tl.load(a + off), tl.load(b + off))
        tl.store(c + off, prod.to(tl.bfloat16).to(tl.float32))

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    c = torch.empty(16, 16)
    with gpu_like_bf16():
        product[(1,)](a, b, c, N=16)
    assert torch.equal(c, (a.float() @ b.float()).bfloat16().float())


def test_chunk_kda_triton_bf16_gate_logit_gradient_strong_gates():
    """bf16 on strong gates (as the GPU computes it, gpu_like_bf16): the gate logit's gradient is within
    1.5x of the error the reference itself makes from bf16 inputs (both against the fp32 reference). It was
    1.8x here (7x on the H200 at 1 x 4096 x 96; 1.3x now): A_qk's diagonal entered dG once from its row side
    and once from its column side, from differently rounded bf16 operands, and the two did not cancel.
    A = e^A_log of 1 and 2, the low end of U(1, 16), where the error was largest on the CPU."""
    lens, H, K, V = [200, 70], 2, 128, 128
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = strong_gates(inputs(1, T, H, K, V, len(lens), seed=0), H, K, seed=0)
    x["A_log"] = torch.tensor([1.0, 2.0]).log()
    xb = {n: (t.bfloat16() if n in ("q", "k", "v", "z", "beta") else t) for n, t in x.items()}
    with gpu_like_bf16():
        g_ours = run_with_grads(chunk_kda, xb, True, True, cu, backend="triton")[2]
    g_ref = run_with_grads(chunk_kda_reference, x, True, True, cu)[2]
    g_ref16 = run_with_grads(chunk_kda_reference, xb, True, True, cu)[2]
    assert rel(g_ours["z"], g_ref["z"]) <= 1.5 * rel(g_ref16["z"], g_ref["z"])


def test_fused_recurrent_triton_matches_naive_both_gates():
    lens = [4, 1, 6]
    x = inputs(1, sum(lens), 2, 16, 48, 3, seed=1)
    cu = torch.tensor([0, 4, 5, 11])
    for lb in (-5.0, None):
        kw = dict(
            initial_state=x["S0"], output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lb,
        )  # fmt: skip
        o1, s1 = fused_recurrent_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], backend="triton", **kw)
        o2, s2 = naive_recurrent_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], **kw)
        assert_close(o1, o2, 1e-5, "o")
        assert_close(s1, s2, 1e-5, "state")


def test_fused_recurrent_triton_fixed_length_batch():
    """B sequences of T tokens (no cu_seqlens: the kernel computes the offsets), with and without the
    streaming cache hints on the state."""
    x = inputs(3, 5, 2, 16, 48, 3, seed=7)
    S0 = torch.randn(3, 2, 16, 48)
    kw = dict(
        initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
    )  # fmt: skip
    o2, s2 = naive_recurrent_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], **kw)
    saved = dict(triton_recurrent.CONFIG)
    for stream in (False, True):
        triton_recurrent.CONFIG.update(stream=stream)
        try:
            o1, s1 = fused_recurrent_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], backend="triton", **kw)
        finally:
            triton_recurrent.CONFIG.update(saved)
        assert_close(o1, o2, 1e-5, f"o (stream={stream})")
        assert_close(s1, s2, 1e-5, f"state (stream={stream})")


def test_fused_recurrent_triton_in_place():
    """The final state written over the initial one (each program reads its slice before writing it)
    equals the out-of-place result, for several V blocks and tokens."""
    x = inputs(2, 3, 2, 16, 48, 2, seed=8)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    args = (x["q"], x["k"], x["v"], x["z"], x["beta"])
    saved = dict(triton_recurrent.CONFIG)
    triton_recurrent.CONFIG.update(BV=16)  # three V blocks of one state
    try:
        o1, s1 = fused_recurrent_kda(
            *args, initial_state=x["S0"], output_final_state=True, backend="triton", **kw
        )
        state = x["S0"].clone()
        o2, s2 = fused_recurrent_kda(
            *args, initial_state=state, inplace_final_state=True, backend="triton", **kw
        )
    finally:
        triton_recurrent.CONFIG.update(saved)
    assert s2 is state
    assert torch.equal(o1, o2) and torch.equal(s1, state)


def test_prefill_then_decode_equals_longer_prefill():
    x = inputs(2, 67, 2, 16, 16, 2, seed=4)
    g = -5.0 * torch.sigmoid(x["z"])
    args = lambda sl: (x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], g[:, sl], x["beta"][:, sl])
    _, S = chunk_kda(*args(slice(0, 66)), output_final_state=True, backend="triton")
    o_dec, S_dec = fused_recurrent_kda(
        *args(slice(66, 67)), initial_state=S, output_final_state=True, backend="triton"
    )
    o_all, S_all = chunk_kda(*args(slice(0, 67)), output_final_state=True, backend="triton")
    assert_close(o_dec[:, 0], o_all[:, 66], 1e-5, "last output")
    assert_close(S_dec, S_all, 1e-5, "state")


def test_triton_chunk_refuses_unsafe_settings():
    x = inputs(1, 8, 1, 16, 16, 1, seed=0)
    args = (x["q"], x["k"], x["v"], x["z"], x["beta"])
    with pytest.raises(ValueError, match="safe gate"):
        chunk_kda(*args, use_gate_in_kernel=True, A_log=x["A_log"], lower_bound=None, backend="triton")
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        chunk_kda(*args, chunk_size=32, backend="triton")
    q = x["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        fused_recurrent_kda(q, *args[1:], backend="triton")
    assert triton_recurrent.recurrent_fwd_kernel is not None


def test_situ_glu_triton_matches_reference_fwd_bwd():
    from k3rl.kernels.situ import situ_glu

    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(3, 1000, generator=gen) * 6).requires_grad_()
    u = (torch.randn(3, 1000, generator=gen) * 40).requires_grad_()
    w = torch.randn(3, 1000, generator=gen)
    (situ_glu(g, u, backend="triton") * w).sum().backward()
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    out_ref = situ_glu(g2, u2, backend="torch")
    (out_ref * w).sum().backward()
    assert torch.allclose(situ_glu(g, u, backend="triton"), out_ref, atol=1e-5)
    assert torch.allclose(g.grad, g2.grad, atol=1e-5) and torch.allclose(u.grad, u2.grad, atol=1e-5)


def test_qb_histogram_triton_matches_reference():
    from k3rl.kernels.qb_histogram import qb_histogram

    gen = torch.Generator().manual_seed(0)
    r = torch.randn(150, 37, generator=gen) * 2
    mask = torch.rand(150, generator=gen) > 0.2
    for tm in (None, mask):
        a = qb_histogram(r, -3.0, 0.05, 100, token_mask=tm, backend="triton")
        b = qb_histogram(r, -3.0, 0.05, 100, token_mask=tm, backend="torch")
        assert a.dtype == torch.int64 and torch.equal(a, b)


def test_l2norm_scale_triton_matches_torch():
    from k3rl.kernels.kda.gate import l2norm
    from k3rl.kernels.kda.triton_l2norm import l2norm_scale_triton

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, 48, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(3, 5, 2, 48, generator=gen)
    (l2norm_scale_triton(x, 0.3) * w).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    ref = l2norm(x2) * 0.3
    (ref * w).sum().backward()
    assert torch.allclose(l2norm_scale_triton(x, 0.3), ref, atol=1e-6)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)


def test_chunk_kda_triton_split_output_matches_reference():
    """The output formed by the parallel kernel after the serial pass (CONFIG split_output)."""
    from k3rl.kernels.kda import triton_chunk

    saved = dict(triton_chunk.CONFIG)
    triton_chunk.CONFIG.update(split_output=True, BV_out=16)
    try:
        test_chunk_kda_triton_matches_reference_fwd_bwd(1, [40, 1, 109], 16, 32, True, True)
    finally:
        triton_chunk.CONFIG.clear()
        triton_chunk.CONFIG.update(saved)


def test_chunk_kda_triton_several_blocks_and_slices_match_reference():
    """Several V blocks and K slices in the gradient kernels (BV 16, K slices of 16)."""
    from k3rl.kernels.kda import triton_chunk

    saved = dict(triton_chunk.CONFIG)
    triton_chunk.CONFIG.update(BV_bwd=16, BV_grads=16, BKS=16, BKS_tiles=16)
    try:
        test_chunk_kda_triton_matches_reference_fwd_bwd(1, [40, 1, 109], 16, 32, True, True)
        test_chunk_kda_triton_matches_reference_fwd_bwd(2, [70], 128, 16, False, False)
    finally:
        triton_chunk.CONFIG.clear()
        triton_chunk.CONFIG.update(saved)


def test_chunk_kda_triton_single_intra_kernel_matches_reference():
    """The forward intra path by the one intra_fwd kernel (CONFIG split_intra = False; the default is
    intra_blocks_fwd + intra_solve_fwd), forward and backward (the backward reads the A_qk, T~, W, U, QG,
    KD it stores), alone and with several V blocks in the U loop (BV 16)."""
    from k3rl.kernels.kda import triton_chunk

    saved = dict(triton_chunk.CONFIG)
    try:
        triton_chunk.CONFIG.update(split_intra=False)
        test_chunk_kda_triton_matches_reference_fwd_bwd(1, [40, 1, 109], 16, 32, True, True)
        test_chunk_kda_triton_matches_reference_fwd_bwd(2, [70], 128, 16, False, False)
        triton_chunk.CONFIG.update(BV=16)
        test_chunk_kda_triton_matches_reference_fwd_bwd(1, [64, 17, 130], 32, 48, True, True)
    finally:
        triton_chunk.CONFIG.clear()
        triton_chunk.CONFIG.update(saved)


def test_split_intra_stores_what_intra_fwd_stores():
    """intra_blocks_fwd + intra_solve_fwd write the same A_qk, T~, W, U, QG, KD as intra_fwd (fp32: equal
    to rounding), on ragged documents with a short last chunk and a one-token document."""
    from k3rl.kernels.kda import triton_chunk as tc

    lens, H, K, V = [70, 1, 133], 2, 32, 48
    T = sum(lens)
    x = inputs(1, T, H, K, V, 1, seed=5)
    cu, chunk_idx, _, NT, _ = tc._tables_from_lengths(lens, "cpu")
    k = torch.nn.functional.normalize(x["k"], dim=-1)
    q = torch.nn.functional.normalize(x["q"], dim=-1) * K**-0.5
    G = torch.empty(1, T, H, K)
    tc.gate_cumsum_fwd_kernel[(NT, H)](
        x["z"], x["A_log"], x["dt_bias"], G, cu, chunk_idx, H=H, K=K, BK=K, USE_GATE=True, HAS_BIAS=True, LB=-5.0
    )  # fmt: skip
    beta, v = x["beta"], x["v"]

    def buffers():  # NaN-filled: every element the kernels should write is checked
        return [torch.full((1, T, H, n), float("nan")) for n in (64, 64, K, V, K, K)]  # Aqk, Ti, W, U, QG, KD

    one = buffers()
    tc.intra_fwd_kernel[(NT, H)](q, k, v, G, beta, *one, cu, chunk_idx, H=H, K=K, V=V, BK=K, BV=16)
    two = buffers()
    Aqk, Tb, W, U, QG, KD = two
    Ti = torch.full((1, T, H, 64), float("nan"))  # scratch: the blocks intra_blocks_fwd passes on
    tc.intra_blocks_fwd_kernel[(NT * 4, H)](
        q, k, G, beta, Aqk, Ti, QG, KD, W, q, k, G, G, 1.0, cu, chunk_idx, H=H, K=K, BK=K
    )  # fmt: skip
    tc.intra_solve_fwd_kernel[(NT, H)](v, beta, Ti, Tb, W, U, cu, chunk_idx, H=H, K=K, V=V, BK=K, BV=16)
    for name, a, b in zip(("A_qk", "T~", "W", "U", "QG", "KD"), one, two, strict=True):
        assert not b.isnan().any(), f"{name}: elements left unwritten"
        assert_close(b, a, 1e-6, name)


def test_chunk_kda_triton_fused_l2norm_matches_separate_pass_and_reference():
    """CONFIG fuse_l2norm: intra_blocks_fwd normalises the raw q, k rows it reads (and stores them with
    their norms for the backward) instead of the separate L2-norm pass; outputs and gradients (raw q, k
    included) equal the separate pass's to fp32 rounding and match the reference, with and without the
    gate in the kernel, ragged documents, K split in two."""
    from k3rl.kernels.kda import triton_chunk as tc

    saved = dict(tc.CONFIG)
    try:
        for lens, K, V, gate, state in (([40, 1, 109], 16, 32, True, True), ([70], 128, 16, False, False)):
            T = sum(lens)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if len(lens) > 1 else None
            x = inputs(1 if cu is not None else 2, T, 2, K, V, len(lens) if cu is not None else 2, seed=T + 1)
            got = {}
            for fuse in (False, True):
                tc.CONFIG.update(fuse_l2norm=fuse)
                got[fuse] = run_with_grads(chunk_kda, x, gate, state, cu, backend="triton")
            o2, s2, g2 = run_with_grads(chunk_kda_reference, x, gate, state, cu)
            (o0, s0, g0), (o1, s1, g1) = got[False], got[True]
            assert_close(o1, o0, 1e-6, "o (fused vs separate norm)")
            assert_close(o1, o2, 1e-4, "o (fused norm vs reference)")
            if state:
                assert_close(s1, s0, 1e-6, "final state (fused vs separate norm)")
            for name in g2:
                assert_close(g1[name], g0[name], 1e-5, f"d{name} (fused vs separate norm)")
                assert_close(g1[name], g2[name], 1e-4, f"d{name} (fused norm vs reference)")
        with torch.no_grad():  # no gradients: nothing stored for the backward, the same output
            tc.CONFIG.update(fuse_l2norm=True)
            o_ng, _ = chunk_kda(
                x["q"], x["k"], x["v"], -5.0 * torch.sigmoid(x["z"]), x["beta"], use_qk_l2norm_in_kernel=True,
                backend="triton",
            )  # fmt: skip
            tc.CONFIG.update(fuse_l2norm=False)
            o_sep, _ = chunk_kda(
                x["q"], x["k"], x["v"], -5.0 * torch.sigmoid(x["z"]), x["beta"], use_qk_l2norm_in_kernel=True,
                backend="triton",
            )  # fmt: skip
        assert_close(o_ng, o_sep, 1e-6, "o without gradients")
    finally:
        tc.CONFIG.clear()
        tc.CONFIG.update(saved)
