"""The KDA sections of benchmarks/kernels.py: chunk forward + backward against fla-core (kda), the
per-kernel profile and launch-setting sweep (profile, sweep), and the outputs' and gradients' agreement
with the fp32 reference (agree, agree_strong)."""

from __future__ import annotations

import torch
from kernel_timing import BF16, DEV, bench, fla_chunk_kda, row, stamp  # beside this file

from k3rl.kernels.kda import chunk_kda, chunk_kda_reference


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
    """Strong gates: A_log = log U(1, 16), dt_bias ~ 0.5 N(0, 1), random beta, an initial
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

