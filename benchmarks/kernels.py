"""Kernel benchmarks on one GPU (H200): KDA chunk / recurrent against fla-core, SiTU-GLU, latent MoE, Newton-Schulz.

Usage (on the GPU machine):  python benchmarks/kernels.py [--only kda,recurrent,agree,situ,moe,ns,peak]
Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up; every comparison
uses the same inputs in the same process. fla-core is optional (the anchor); without it only
our numbers are printed.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import traceback

import torch
import triton


def _load_kernels_alone():
    """Import k3rl.kernels without k3rl/__init__ (the GPU image lacks k3rl's other dependencies)."""
    import importlib.util
    import pathlib
    import sys
    import types

    try:
        import k3rl.kernels  # noqa: F401
    except ImportError:
        root = pathlib.Path(__file__).resolve().parents[1]
        pkg = types.ModuleType("k3rl")
        pkg.__path__ = []
        sys.modules["k3rl"] = pkg
        spec = importlib.util.spec_from_file_location(
            "k3rl.kernels",
            root / "kernels" / "__init__.py",
            submodule_search_locations=[str(root / "kernels")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["k3rl.kernels"] = mod
        spec.loader.exec_module(mod)


_load_kernels_alone()
from triton.testing import do_bench  # noqa: E402

from k3rl.kernels.kda import chunk_kda, chunk_kda_reference, fused_recurrent_kda, kda_gate, l2norm  # noqa: E402
from k3rl.kernels.moe import latent_experts  # noqa: E402
from k3rl.kernels.newton_schulz import newton_schulz, newton_schulz_loop  # noqa: E402
from k3rl.kernels.situ import situ_glu, situ_glu_formula  # noqa: E402

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
except ImportError:  # pragma: no cover - the anchor is optional
    fla_chunk_kda = fla_fused_recurrent_kda = None

DEV = "cuda"
BF16 = torch.bfloat16


def bench(fn, grad_to_none=None, rep=200):
    return do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


_T0 = None


def stamp(what):
    """Progress line with the seconds since the start (a stalled phase shows as the last stamp)."""
    import time

    global _T0
    _T0 = _T0 or time.time()
    print(f"[{time.time() - _T0:7.1f} s] {what}", flush=True)


def row(*cells):
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def peak():
    print("\n## Ceilings (measured)\n")
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms = bench(lambda: a @ b, rep=100)
    copy, copy_bytes = big_copy()
    ms_copy = bench(copy, rep=100)
    tflops = 2 * 8192**3 / ms / 1e9
    bw = copy_bytes / ms_copy / 1e6  # GB/s
    row("bf16 matmul 8192^3 (random)", f"{tflops:.0f} TFLOP/s")
    row("device copy 2 GiB (read + write)", f"{bw / 1000:.2f} TB/s")
    return tflops, bw


def big_copy():
    """A 2 GiB device-to-device copy (the bandwidth ceiling) and the bytes it moves (read + write)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return (lambda: y.copy_(x)), 2 * x.numel()


def kda_inputs(B, T, H, K=128, V=128, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, dt=BF16: torch.randn(*s, generator=gen, device=DEV, dtype=dt)
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K),
        beta=torch.rand(B, T, H, generator=gen, device=DEV, dtype=BF16),
        A_log=torch.log(torch.empty(H, device=DEV).uniform_(1, 4, generator=gen)),
        dt_bias=r(H * K, dt=torch.float32) * 0.5 - 3.0,
    )  # fmt: skip


GATE = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)


def ours_kda(x, **kw):
    return chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], **GATE, **kw
    )


def fla_kda(x, **kw):
    return fla_chunk_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        safe_gate=True,
        **GATE,
        **kw,
    )


def time_fwd_bwd(fn, x):
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for t in leaves:
        t.requires_grad_(True)
    do = torch.randn_like(x["v"])

    def step():
        o, _ = fn(x)
        o.backward(do)

    ms = bench(step, grad_to_none=leaves, rep=300)
    for t in leaves:
        t.requires_grad_(False)
        t.grad = None
    return ms


KDA_SHAPES = "1x4096x96,1x16384x96,1x65536x96,8x4096x32"


def kda(shapes=KDA_SHAPES):
    print("\n## KDA chunk (bf16, K = V = 128, safe gate -5, gate + q/k L2 norm in kernel)\n")
    row(
        "B, T, H",
        "ours fwd ms",
        "fla fwd ms",
        "fla/ours fwd",
        "ours fwd+bwd ms",
        "fla fwd+bwd ms",
        "fla/ours fwd+bwd",
    )
    row(*["---"] * 7)
    for B, T, H in (tuple(int(n) for n in s.split("x")) for s in shapes.split(",")):
        x = kda_inputs(B, T, H)
        # ours first, then fla-core (whose first call of a new head count autotunes), each phase stamped
        stamp(f"{B}x{T}x{H} ours fwd")
        with torch.no_grad():
            ours_f = bench(lambda x=x: ours_kda(x))
        stamp(f"{B}x{T}x{H} ours fwd+bwd")
        ours_fb = time_fwd_bwd(ours_kda, x)
        stamp(f"{B}x{T}x{H} fla fwd")
        with torch.no_grad():
            fla_f = bench(lambda x=x: fla_kda(x)) if fla_chunk_kda else float("nan")
        stamp(f"{B}x{T}x{H} fla fwd+bwd")
        fla_fb = time_fwd_bwd(fla_kda, x) if fla_chunk_kda else float("nan")
        row(
            f"{B}, {T}, {H}",
            f"{ours_f:.3f}",
            f"{fla_f:.3f}",
            f"{fla_f / ours_f:.2f}x",
            f"{ours_fb:.3f}",
            f"{fla_fb:.3f}",
            f"{fla_fb / ours_fb:.2f}x",
        )
        del x
        torch.cuda.empty_cache()


def profile(B=1, T=4096, H=96, with_fla=True):
    """Per-kernel CUDA time of one forward + backward of ours and of fla-core (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = kda_inputs(B, T, H)
    for name, fn in (("ours", ours_kda), ("fla-core", fla_kda if fla_chunk_kda and with_fla else None)):
        if fn is None:
            continue
        time_fwd_bwd(fn, x)  # compile / autotune outside the trace
        leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
        for t in leaves:
            t.requires_grad_(True)
        do = torch.randn_like(x["v"])
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                o, _ = fn(x)
                o.backward(do)
            torch.cuda.synchronize()
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
        print(f"\n### {name}: CUDA time per forward + backward by kernel ({B}x{T}x{H})\n")
        row("kernel", "ms per call", "calls per step")
        row(*["---"] * 3)
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]:
            row(ev.key[:70], f"{ev.device_time_total / 5 / 1000:.3f}", ev.count // 5)


# (kernel, change against the defaults). With --adopt-best the sections after the sweep use, per kernel,
# the fastest of its changes and the defaults (by the forward time for intra and state_fwd, by forward
# + backward for the others), among those whose output and gradients agree with the defaults'.
SWEEP = [
    ("defaults", {}),
    ("intra", {"split_intra": False}),  # the single intra_fwd kernel (8 warps)
    ("intra", {"warps_blocks": 8}),
    ("intra", {"warps_blocks": 2}),
    ("intra", {"warps_solve": 8}),
    ("intra", {"fuse_l2norm": False}),  # the q/k L2 norm as a pass of its own
    ("state_fwd", {"warps_state": 8, "stages_state": 2}),
    ("state_fwd", {"stages_state": 1}),
    ("state_fwd", {"BV": 32}),
    # one program per (sequence, head): 96 programs at 1 x 4096 x 96 run in one round on 132 SMs (BV 64:
    # 192 programs of 147 KB shared memory, one per SM, two rounds); sm_90 compile: 255 registers, no spill
    ("state_fwd", {"BV": 128, "warps_state": 8}),
    ("state_fwd", {"BV": 128, "warps_state": 8, "stages_state": 1}),
    ("state_fwd", {"split_output": True}),  # the state pass without O, then O by a parallel kernel
    ("state_fwd", {"split_output": True, "BV_out": 128, "warps_out": 8}),
    ("gate", {"warps_gate": 8}),
    ("gate", {"warps_gate": 2}),
    ("state_bwd", {"BV_bwd": 32}),
    ("state_bwd", {"BV_bwd": 128, "warps_state_bwd": 8}),
    # ("grads", {"stages_grads": 1}) faults with an illegal address on the H200 (Triton 3.6, 2026-12-02) and
    # poisons the process's CUDA context: not swept
    ("grads", {"BKS": 16}),
    ("grads", {"BKS": 64, "warps_grads": 8}),
    ("tiles", {"BKS_tiles": 32, "warps_subtiles": 2}),
    ("tiles", {"BKS_tiles": 128, "warps_subtiles": 8}),
]
FWD_KERNELS = ("intra", "state_fwd", "gate")


def sweep(B=1, T=4096, H=96, adopt=False, groups=None):
    """Our chunk KDA under several launch settings (one change each against the defaults); each
    setting's output and gradients are compared with the defaults' on the same inputs."""
    from k3rl.kernels.kda import triton_chunk

    base = dict(triton_chunk.CONFIG)
    x = kda_inputs(B, T, H)
    print(f"\n## KDA chunk launch settings ({B}x{T}x{H}); defaults {base}\n")
    row("kernel", "change", "fwd ms", "fwd+bwd ms", "o vs defaults", "grads vs defaults (max rel)")
    row(*["---"] * 6)
    ref, results = None, []

    def measure(group, change):
        nonlocal ref
        triton_chunk.CONFIG.clear()
        triton_chunk.CONFIG.update(base, **change)
        try:
            stamp(f"sweep {change}")
            got = outputs_and_grads(x)  # the same numbers under every setting (bf16 rounding aside)
            ref = ref or got
            diffs = [rel(a, b) for a, b in zip(got, ref, strict=True)]
            with torch.no_grad():
                f = bench(lambda: ours_kda(x))
            fb = time_fwd_bwd(ours_kda, x)
            row(group, change, f"{f:.3f}", f"{fb:.3f}", f"{diffs[0]:.1e}", f"{max(diffs[1:]):.1e}")
            if diffs[0] < 1e-3 and max(diffs[1:]) < 1e-2:
                results.append((group, change, f, fb))
        except Exception as e:  # a setting that does not compile must not stop the sweep
            row(group, change, "failed", str(e).splitlines()[0][:80], "", "")

    rows = [(g, c) for g, c in SWEEP if g == "defaults" or not groups or g in groups]
    for group, change in rows:
        measure(group, change)
    chosen = dict(base)
    defaults = [r for r in results if r[0] == "defaults"]
    if adopt and defaults:
        for kernel in dict.fromkeys(g for g, _ in rows if g != "defaults"):
            by = 2 if kernel in FWD_KERNELS else 3
            best = min(defaults + [r for r in results if r[0] == kernel], key=lambda r: r[by])
            chosen.update(best[1])
        measure("adopted", {k: v for k, v in chosen.items() if base.get(k) != v})
    triton_chunk.CONFIG.clear()
    triton_chunk.CONFIG.update(chosen)
    print(f"\nKDA chunk launch config from here on: {chosen}", flush=True)


def outputs_and_grads(x, fn=None):
    """o and the gradients of q, k, v, g, beta for a fixed dO (inputs left without grads)."""
    leaves = ("q", "k", "v", "g", "beta")
    xs = {n: (t.detach().clone().requires_grad_(True) if n in leaves else t) for n, t in x.items()}
    o, _ = (fn or ours_kda)(xs)
    gen = torch.Generator(device=DEV).manual_seed(3)
    o.backward(torch.randn(o.shape, generator=gen, device=DEV, dtype=o.dtype))
    return [o.detach()] + [xs[n].grad for n in leaves]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def agree():
    print("\n## Numerical agreement (B, T, H = 1, 4096, 96; bf16 inputs; relative L2 error)\n")
    x = kda_inputs(1, 4096, 96, seed=1)
    leaves = ("q", "k", "v", "g", "beta")
    do = torch.randn_like(x["v"])
    h0 = torch.randn(1, 96, 128, 128, device=DEV) * 0.1

    def run(fn, cast=None):
        xs = {
            n: (t.detach().to(cast) if cast and t.dtype == BF16 else t.detach()).clone() for n, t in x.items()
        }
        for n in leaves:
            xs[n].requires_grad_(True)
        o, s = fn(xs, initial_state=h0, output_final_state=True)
        (o.float() * do.float()).sum().backward()
        return o, s, [xs[n].grad for n in leaves]

    ref = run(lambda xs, **kw: chunk_kda_reference(
        xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], A_log=xs["A_log"], dt_bias=xs["dt_bias"], **GATE, **kw
    ), cast=torch.float32)  # fmt: skip
    mine = run(ours_kda)
    row("quantity", "ours vs fp32 reference", "fla vs fp32 reference", "ours vs fla")
    row(*["---"] * 4)
    theirs = run(fla_kda) if fla_chunk_kda else None
    names = ["o", "final state"] + [f"d{n}" for n in leaves]
    flat = lambda r: [r[0], r[1], *r[2]]
    for name, a, b, c in zip(
        names, flat(mine), flat(ref), flat(theirs) if theirs else [None] * 7, strict=True
    ):
        row(
            name,
            f"{rel(a, b):.2e}",
            f"{rel(c, b):.2e}" if c is not None else "-",
            f"{rel(a, c):.2e}" if c is not None else "-",
        )


def strong_gate_inputs(lens, H, K=128, V=128, seed=0):
    """The issue's strong gates: A_log = log U(1, 16), dt_bias ~ 0.5 N(0, 1), random beta, an initial
    state, ragged documents (fp32 here; each run casts)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), z=r(1, T, H, K),
             beta=torch.rand(1, T, H, generator=gen, device=DEV))  # fmt: skip
    gate = dict(A_log=torch.empty(H, device=DEV).uniform_(1, 16, generator=gen).log(), dt_bias=0.5 * r(H * K))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    return x, gate, cu, r(len(lens), H, K, V) * 0.1


def grads_of(fn, x, gate, cu, S0, dtype, **kw):
    """o, final state and the gradients of q, k, v, z, beta, S0 for a fixed random dO and dS."""
    leaves = {n: t.to(dtype).clone().requires_grad_() for n, t in x.items()}
    h0 = S0.clone().requires_grad_()
    o, s = fn(
        leaves["q"], leaves["k"], leaves["v"], leaves["z"], leaves["beta"], initial_state=h0,
        output_final_state=True, cu_seqlens=cu, **gate, **GATE, **kw,
    )  # fmt: skip
    gen = torch.Generator(device=DEV).manual_seed(7)
    ((o.float() * torch.randn(o.shape, generator=gen, device=DEV)).sum() + s.sum()).backward()
    return (
        {"o": o.detach(), "final state": s.detach()}
        | {f"d{n}": t.grad for n, t in leaves.items()}
        | {"dS0": h0.grad}
    )


def agree_strong(lens=(4096, 1000, 3000), H=96):
    """Relative L2 error against the fp32 reference on strong gates: ours (bf16), fla-core (bf16), and the
    PyTorch reference itself in bf16 (its inputs rounded, fp32 inside): the floor of bf16 inputs."""
    print(f"\n## Numerical agreement on strong gates (documents {list(lens)}, H = {H}; relative L2 error)\n")
    x, gate, cu, S0 = strong_gate_inputs(list(lens), H)
    ref = grads_of(chunk_kda_reference, x, gate, cu, S0, torch.float32)
    runs = {"ours bf16": grads_of(chunk_kda, x, gate, cu, S0, BF16)}
    if fla_chunk_kda:
        runs["fla-core bf16"] = grads_of(
            lambda *a, **kw: fla_chunk_kda(*a, safe_gate=True, **kw), x, gate, cu, S0, BF16
        )
    runs["reference bf16"] = grads_of(chunk_kda_reference, x, gate, cu, S0, BF16)
    row("quantity", *runs)
    row(*["---"] * (len(runs) + 1))
    for name in ref:
        row(name, *(f"{rel(r[name], ref[name]):.2e}" for r in runs.values()))


def bench_graph(fn, calls=20, replays=10):
    """ms per call of `calls` back-to-back calls captured in one CUDA graph: no launch gaps and no cache
    flush between calls (do_bench flushes L2 before each call and times each launch on its own)."""
    try:
        return _bench_graph(fn, calls, replays)
    except RuntimeError as e:  # a call that syncs with the host cannot be captured: report, go on
        print(f"(CUDA graph capture failed: {str(e).splitlines()[0][:100]})")
        return float("nan")


def _bench_graph(fn, calls, replays):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (calls * replays))
    return sorted(times)[len(times) // 2]


def recurrent(bw, sweep_configs=True):
    print("\n## Fused recurrent KDA, one decode token (64 sequences x 96 heads, fp32 state in and out)\n")
    B, H, K, V = 64, 96, 128, 128
    x = kda_inputs(B, 1, H, seed=2)
    h0 = torch.randn(B, H, K, V, device=DEV)
    state = h0.clone()  # the in-place calls' state (updated by every call)
    state_bytes = 2 * h0.numel() * 4
    from k3rl.kernels.kda import triton_recurrent

    args = lambda: (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **GATE)
    out_of_place = lambda: fused_recurrent_kda(*args(), initial_state=h0, output_final_state=True, **kw)
    in_place = lambda: fused_recurrent_kda(*args(), initial_state=state, inplace_final_state=True, **kw)
    with torch.no_grad():
        # the same state bytes through a plain device copy: the ceiling for a kernel that reads the
        # state once and writes it once (the 2 GiB copy of `peak` amortises its launch and tail better)
        ht_copy = torch.empty_like(h0)
        copy = lambda: ht_copy.copy_(h0)
        copy_2g, bytes_2g = big_copy()
        saved = dict(triton_recurrent.CONFIG)
        sweep = {}
        configs = [
            (bv, nw, False) for bv in (16, 32, 64, 128) for nw in (1, 2, 4, 8) if bv * 128 // (32 * nw) <= 256
        ]
        if not sweep_configs:  # the committed defaults only
            configs = [(saved["BV"], saved["num_warps"], saved["stream"])]
        for inplace in (False, True):
            for bv, nw, stream in configs + ([(32, 2, True)] if sweep_configs else []):
                triton_recurrent.CONFIG.update(BV=bv, num_warps=nw, stream=stream)
                sweep[(bv, nw, stream, inplace)] = bench(in_place if inplace else out_of_place)
        print("config sweep (BV, warps, stream, in place) -> ms:", {k: round(v, 4) for k, v in sweep.items()})
        timed = {}
        for inplace in (False, True):
            best = min((c for c in sweep if c[3] == inplace), key=sweep.get)
            triton_recurrent.CONFIG.update(BV=best[0], num_warps=best[1], stream=best[2])
            fn = in_place if inplace else out_of_place
            name = f"ours, {'in place' if inplace else 'out of place'} (BV {best[0]}, {best[1]} warps)"
            timed[name] = (bench(fn), bench_graph(fn))
        # the fastest way to call either kernel: q, k normalised (q scaled) and the fp32 gate computed
        # once outside the call, as an engine that keeps them would
        pre = (
            l2norm(x["q"]).mul(K**-0.5).to(BF16), l2norm(x["k"]).to(BF16), x["v"],
            kda_gate(x["g"], x["A_log"], x["dt_bias"], GATE["lower_bound"]), x["beta"],
        )  # fmt: skip
        pre_kw = dict(scale=1.0, initial_state=h0, output_final_state=True)
        ours_pre = lambda: fused_recurrent_kda(*pre, **pre_kw)
        timed["ours, pre-normalised q/k, fp32 gate (out of place)"] = (bench(ours_pre), bench_graph(ours_pre))
        if fla_fused_recurrent_kda:
            fla = lambda: fla_fused_recurrent_kda(*args(), initial_state=h0, output_final_state=True, **kw)
            timed["fla-core 0.6.0 fused_recurrent_kda (out of place)"] = (bench(fla), bench_graph(fla))
            fla_pre = lambda: fla_fused_recurrent_kda(*pre, **pre_kw)
            timed["fla-core, pre-normalised q/k, fp32 gate (its fastest call)"] = (
                bench(fla_pre),
                bench_graph(fla_pre),
            )
            o3, s3 = fla_pre()
            o4, s4 = ours_pre()
            print(
                f"agreement ours vs fla, pre-normalised: o rel {rel(o4, o3):.2e}, state rel {rel(s4, s3):.2e}"
            )
            triton_recurrent.CONFIG.update(saved)  # agreement at the committed defaults
            o1, s1 = out_of_place()
            o2, s2 = fla()
            print(f"agreement ours vs fla: o rel {rel(o1, o2):.2e}, state rel {rel(s1, s2):.2e}\n")
        timed["torch copy of the same state"] = (bench(copy), bench_graph(copy))
        big_ms = (bench(copy_2g, rep=100), bench_graph(copy_2g, calls=5, replays=4))
    triton_recurrent.CONFIG.update(saved)
    big_bw = [bytes_2g / ms / 1e9 for ms in big_ms]  # TB/s
    print(
        f"2 GiB copy: {big_bw[0]:.2f} TB/s timed per launch (peak section: {bw / 1000:.2f}), "
        f"{big_bw[1]:.2f} TB/s back to back\n"
    )
    row(
        "kernel", "ms per launch", "TB/s", "of the 2 GiB copy", "ms back to back", "TB/s", "of the 2 GiB copy"
    )
    row(*["---"] * 7)
    for name, (ms, ms_g) in timed.items():
        tbs, tbs_g = state_bytes / ms / 1e9, state_bytes / ms_g / 1e9
        row(
            name, f"{ms:.4f}", f"{tbs:.2f}", f"{100 * tbs / big_bw[0]:.1f}%",
            f"{ms_g:.4f}", f"{tbs_g:.2f}", f"{100 * tbs_g / big_bw[1]:.1f}%",
        )  # fmt: skip


def situ():
    print("\n## SiTU-GLU (bf16 [32768, 3072] gate and up, fp32 island)\n")
    g = torch.randn(32768, 3072, device=DEV, dtype=BF16) * 3
    u = torch.randn_like(g) * 3
    compiled = torch.compile(situ_glu_formula)
    row("version", "fwd ms", "fwd+bwd ms")
    row(*["---"] * 3)
    dout = torch.randn_like(g)
    for name, fn in (
        ("eager formula", situ_glu_formula),
        ("torch.compile formula", compiled),
        ("ours (Triton, fused fwd / bwd)", lambda a, b: situ_glu(a, b, backend="triton")),
    ):
        fwd = bench(lambda fn=fn: fn(g, u))
        gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
        fb = bench(lambda fn=fn, gg=gg, uu=uu: fn(gg, uu).backward(dout), grad_to_none=[gg, uu])
        row(name, f"{fwd:.3f}", f"{fb:.3f}")


def moe(peak_tflops):
    print("\n## Latent MoE experts (bf16; N = 16384 tokens, top-8 of 64 experts, l = 3584, f = 3072)\n")
    N, E, k, dim, f = 16384, 64, 8, 3584, 3072
    z = torch.randn(N, dim, device=DEV, dtype=BF16)
    idx = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(N)])
    w = torch.rand(N, k, device=DEV)
    w1 = torch.randn(E, f, dim, device=DEV, dtype=BF16) * dim**-0.5
    w3 = torch.randn_like(w1)
    w2 = torch.randn(E, dim, f, device=DEV, dtype=BF16) * f**-0.5
    flops = 2 * 3 * N * k * f * dim
    row("path", "fwd ms", "fwd TFLOP/s", "of bf16 peak", "fwd+bwd ms", "fwd+bwd TFLOP/s")
    row(*["---"] * 6)
    for name, backend in (("grouped (torch._grouped_mm)", "triton"), ("loop over experts", "torch")):
        with torch.no_grad():
            ms = bench(lambda b=backend: latent_experts(z, idx, w, w1, w3, w2, backend=b), rep=100)
        params = [t.requires_grad_() for t in (z, w1, w3, w2)]
        fb = bench(
            lambda b=backend: (
                latent_experts(z, idx, w, w1, w3, w2, backend=b).float().square().mean().backward()
            ),
            grad_to_none=params,
            rep=100,
        )
        for t in params:
            t.requires_grad_(False)
        row(
            name,
            f"{ms:.2f}",
            f"{flops / ms / 1e9:.0f}",
            f"{100 * flops / ms / 1e9 / peak_tflops:.0f}%",
            f"{fb:.2f}",
            f"{3 * flops / fb / 1e9:.0f}",
        )
    with torch.no_grad():
        a = latent_experts(z[:2048], idx[:2048], w[:2048], w1, w3, w2, backend="triton")
        b = latent_experts(z[:2048], idx[:2048], w[:2048], w1, w3, w2, backend="torch")
    print(f"\ngrouped vs loop: relative L2 difference {rel(a, b):.2e}")


def ns():
    print("\n## Newton-Schulz, 5 steps, bf16\n")
    row("batch", "batched ms", "per-matrix loop ms", "speed-up")
    row(*["---"] * 4)
    for shape in ((96, 128, 7168), (96, 192, 1536), (8, 3072, 3584)):
        G = torch.randn(*shape, device=DEV)
        a = bench(lambda G=G: newton_schulz(G), rep=100)
        b = bench(lambda G=G: newton_schulz_loop(G), rep=100)
        row(f"{shape[0]} x [{shape[1]}, {shape[2]}]", f"{a:.2f}", f"{b:.2f}", f"{b / a:.1f}x")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="peak,kda,agree,recurrent,situ,moe,ns")
    p.add_argument(
        "--peak-tflops", type=float, default=772.0, help="bf16 matmul ceiling when 'peak' is skipped"
    )
    p.add_argument(
        "--copy-gbs", type=float, default=4270.0, help="copy bandwidth (GB/s) when 'peak' is skipped"
    )
    p.add_argument("--kda-shapes", default=KDA_SHAPES, help="B x T x H list for the KDA section")
    p.add_argument(
        "--kda-config", default="", help="launch settings for our chunk kernels, e.g. BV=64,warps_state=4"
    )
    p.add_argument(
        "--adopt-best", action="store_true", help="the sections after 'sweep' use its best settings"
    )
    p.add_argument(
        "--shape", default="1x4096x96", help="B x T x H of the profile and sweep sections (e.g. 1x16384x96)"
    )
    p.add_argument("--sweep-groups", default="", help="sweep only these kernels' rows, e.g. intra,state_fwd")
    p.add_argument(
        "--watchdog", type=float, default=0, help="dump all Python stacks every N seconds (0: off)"
    )
    args = p.parse_args()
    if args.watchdog:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(args.watchdog, repeat=True, file=sys.stdout)
    which = set(args.only.split(","))
    if args.kda_config:
        from k3rl.kernels.kda import triton_chunk

        triton_chunk.CONFIG.update(
            {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.kda_config.split(",")}
        )
        print("KDA chunk launch config:", triton_chunk.CONFIG)
    print(f"# kernels benchmark {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"python {platform.python_version()}, fla-core {'present' if fla_chunk_kda else 'absent'}")  # fmt: skip
    shape = tuple(int(n) for n in args.shape.split("x"))
    tflops, bw = peak() if "peak" in which else (args.peak_tflops, args.copy_gbs)
    sections = dict(
        kda=lambda: kda(args.kda_shapes),
        kda_long=lambda: kda("1x16384x96,1x65536x96"),
        sweep=lambda: sweep(
            *shape, adopt=args.adopt_best, groups=args.sweep_groups.split(",") if args.sweep_groups else None
        ),
        profile=lambda: profile(*shape),
        profile_ours=lambda: profile(*shape, with_fla=False),
        agree=agree,
        recurrent=lambda: recurrent(bw),
        recurrent_quick=lambda: recurrent(bw, sweep_configs=False),
        agree_strong=agree_strong,
        situ=situ,
        moe=lambda: moe(tflops),
        ns=ns,
    )
    for name in args.only.split(","):  # in the order given
        fn = sections.get(name)
        if fn is not None:
            stamp(f"section {name}")
            try:  # one failing section must not hide the others' numbers
                fn()
            except Exception:
                print(f"\n{name} FAILED:\n{traceback.format_exc()}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
