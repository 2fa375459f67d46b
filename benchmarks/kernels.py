"""Kernel benchmarks on one GPU (H200): KDA chunk / recurrent against fla-core, SiTU-GLU, latent MoE, Newton-Schulz.

Usage (on the GPU machine):  python benchmarks/kernels.py [--only kda,recurrent,agree,situ,islands,moe,ns,peak]
Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up; every comparison
uses the same inputs in the same process. fla-core is optional (the anchor); without it only
our numbers are printed. The KDA sections live in kernels_kda.py, the shared timing in kernel_timing.py.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import traceback

import torch
import triton
from kernel_timing import (  # kernel_timing.py and kernels_kda.py, beside this file
    BF16,
    DEV,
    bench,
    bench_graph,
    big_copy,
    fla_chunk_kda,
    fla_fused_recurrent_kda,
    peak,
    row,
    stamp,
)
from kernels_kda import GATE, KDA_SHAPES, agree, agree_strong, kda, kda_inputs, profile, rel, sweep

from k3rl.kernels.kda import fused_recurrent_kda, kda_gate, l2norm
from k3rl.kernels.moe import latent_experts
from k3rl.kernels.newton_schulz import newton_schulz, newton_schulz_loop
from k3rl.kernels.situ import situ_glu, situ_glu_formula


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


def islands(bw):
    """The k3-small learner's row-wise kernels at its micro-batch ([65536, 768] bf16, 16 documents):
    KDA's short conv and RMSNorm, forward and backward, as a share of the copy bandwidth; the
    short conv's backward pass 1 and RMSNorm's backward over their launch settings."""
    from k3rl.kernels.kda import triton_short_conv as tc
    from k3rl.kernels.rmsnorm import triton_rmsnorm as tr

    T, C, W = 65536, 768, 4
    print(f"\n## Row-wise kernels at the k3-small micro-batch ([{T}, {C}] bf16, 16 documents)\n")
    cu = torch.arange(0, T + 1, T // 16, device=DEV, dtype=torch.int32)
    x = torch.randn(1, T, C, device=DEV, dtype=BF16).requires_grad_()
    w = (torch.randn(C, 1, W, device=DEV) * 0.5).requires_grad_()
    dy = torch.randn_like(x)
    gb = lambda nbytes, ms: f"{nbytes / ms / 1e6:.0f} GB/s ({100 * nbytes / ms / 1e6 / bw:.0f}%)"  # noqa: E731
    row("kernel", "settings", "ms", "bandwidth (of copy)")
    row(*["---"] * 4)
    fwd = bench(lambda: tc.short_conv_triton(x, w, cu))
    row("short conv forward", f"BT={tc.BT} BC={tc.BC}", f"{fwd:.3f}", gb(4 * T * C, fwd))
    y = tc.short_conv_triton(x, w, cu)
    default = (tc.DA_BT, tc.DA_NB, tc.DA_WARPS)
    for bt, nb, warps in sorted({default, (32, 8, 4), (32, 32, 4), (16, 32, 4), (64, 8, 4)}):
        tc.DA_BT, tc.DA_NB, tc.DA_WARPS = bt, nb, warps
        ms = bench(lambda: y.backward(dy, retain_graph=True), grad_to_none=[x, w])
        mark = " (default)" if (bt, nb, warps) == default else ""
        # da pass: x, dy read, da (fp32) written; dx pass: da read, dx written
        row("short conv backward", f"DA_BT={bt} DA_NB={nb} warps={warps}{mark}", f"{ms:.3f}", gb(14 * T * C, ms))
    tc.DA_BT, tc.DA_NB, tc.DA_WARPS = default
    xn = torch.randn(T, C, device=DEV, dtype=BF16).requires_grad_()
    wn = torch.randn(C, device=DEV, dtype=BF16).requires_grad_()
    fwd = bench(lambda: tr.RMSNormFn.apply(xn, wn, 1e-6))
    row("RMSNorm forward", f"ROWS={tr.ROWS}", f"{fwd:.3f}", gb(4 * T * C, fwd))
    yn = tr.RMSNormFn.apply(xn, wn, 1e-6)
    dyn = torch.randn_like(yn)
    default = (tr.BWD_ROWS, tr.MAX_PROGRAMS)
    for rows, progs in sorted({default, (4096, 1024), (2048, 2048), (2048, 8192), (1024, 4096), (1024, 8192)}):
        tr.BWD_ROWS, tr.MAX_PROGRAMS = rows, progs
        ms = bench(lambda: yn.backward(dyn, retain_graph=True), grad_to_none=[xn, wn])
        mark = " (default)" if (rows, progs) == default else ""
        row("RMSNorm backward", f"BWD_ROWS={rows} MAX_PROGRAMS={progs}{mark}", f"{ms:.3f}", gb(6 * T * C, ms))
    tr.BWD_ROWS, tr.MAX_PROGRAMS = default


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
        islands=lambda: islands(bw),
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
