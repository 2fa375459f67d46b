"""Gated MLA's attention on a GPU: the Triton flash kernel (kernels/attention/triton_flash.py) against PyTorch's
SDPA path, forward + backward, bf16 inputs as the learner's autocast gives them, in the same process.

    # one H200 (issue 22, item 2): K3's MLA head dims (q/k 192, v 128), 96 heads (one GPU's share at full width),
    # 8K and 32K tokens of packed documents; then a GRPO group of 16 over a shared 4K prompt (issue 25)
    python benchmarks/mla_attention.py --heads 96 --tokens 8192 32768 --docs 4 --group 16 --prefix 4096 \\
        --completion 256 --json mla_attention.json

Cases: `packed` (the documents of `--tokens` split into `--docs` equal documents, causal within each) and
`shared` (`--group` branches of `--completion` tokens after one prefix of `--prefix` tokens; SDPA copies the
prefix's keys and values once per branch, the kernel reads them in place). The report: median milliseconds
of `--iters` timed calls after `--warmup` of each (alternated), the attention FLOPs a second
(causal: 2 H (Dqk + Dv) x the attending pairs, the backward counted as 2.5 forwards) and each path's peak
memory. Both paths run under bf16 autocast, as the learner calls them (the SDPA path then runs PyTorch's
fused bf16 kernels; without autocast it widens q, k, v to fp32). `--sweep` first times the kernel's launch
shapes. Accuracy is tests/kernels/test_flash_attention.py's (run it first on a new GPU). Needs k3rl
installed (on the device: benchmarks/device_env.sh). Numbers: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from k3rl.kernels.attention import causal_attention, shared_prefix_attention

D, DV = 192, 128


def _timed(fn, iters: int) -> tuple[float, float]:
    """Median ms of fn() (forward + backward) and its peak GiB."""
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def case(kind: str, args, tokens: int, only: str | None = None) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    H = args.heads
    if kind == "packed":
        lengths, P = [tokens // args.docs] * args.docs, 0
        pairs = sum(n * (n + 1) // 2 for n in lengths)
    else:
        lengths, P = [args.completion] * args.group, args.prefix
        pairs = args.group * (P * args.completion + args.completion * (args.completion + 1) // 2)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def rand(n, d):
        return torch.randn(1, n, H, d, generator=gen, device="cuda").bfloat16().requires_grad_()

    q, k, v = rand(T, D), rand(T, D), rand(T, DV)
    kp, vp = rand(max(P, 1), D), rand(max(P, 1), DV)
    do = torch.randn(1, T, H, DV, device="cuda", generator=gen)

    def call(kernel):  # under the learner's bf16 autocast (without it the SDPA path widens to fp32)
        with torch.autocast("cuda", torch.bfloat16):
            if P:
                return shared_prefix_attention(q, k, v, kp, vp, D**-0.5, cu, backend="triton", kernel=kernel)
            return causal_attention(q, k, v, D**-0.5, cu_seqlens=cu, backend="triton", kernel=kernel)

    def step(kernel):
        for x in (q, k, v, kp, vp):
            x.grad = None
        call(kernel).float().backward(do)

    kernels = (only,) if only else ("flash", "sdpa")
    for _ in range(args.warmup):
        for kernel in kernels:
            step(kernel)
    out = {"case": kind, "tokens": T, "prefix": P, "heads": H, "docs": len(lengths)}
    flops = 2 * H * (D + DV) * pairs * 3.5  # forward 1 + backward 2.5
    for kernel in kernels:
        ms, peak = _timed(lambda kernel=kernel: step(kernel), args.iters)
        out[f"{kernel}_ms"], out[f"{kernel}_peak_gib"] = ms, peak
        out[f"{kernel}_tflops"] = flops / ms / 1e9
    if not only:
        out["speedup"] = out["sdpa_ms"] / out["flash_ms"]
    return out


SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 128, 8, 2)]


def sweep(args) -> list[dict]:
    """The kernel's launch shapes (BLOCK_M, BLOCK_N, num_warps, num_stages), each timed on the first packed
    case and the shared case; a shape the GPU cannot hold (shared memory) is reported, not fatal."""
    # imported here: the launch shape is the module's globals, set per row
    from k3rl.kernels.attention import triton_flash as tf

    kept = (tf.BLOCK_M, tf.BLOCK_N, dict(tf.LAUNCH))
    rows = []
    try:
        for bm, bn, warps, stages in SWEEP:
            tf.BLOCK_M, tf.BLOCK_N, tf.LAUNCH = bm, bn, {"num_warps": warps, "num_stages": stages}
            row = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            for kind, tokens in (("packed", args.tokens[0]), ("shared", args.prefix)):
                try:
                    r = case(kind, args, tokens, only="flash")
                    row[f"{kind}_ms"] = r["flash_ms"]
                except Exception as e:  # noqa: BLE001 - triton's OutOfResources and its kin: the row says which
                    row[f"{kind}_ms"] = None
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        tf.BLOCK_M, tf.BLOCK_N, tf.LAUNCH = kept
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="first time the kernel's launch shapes (SWEEP)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mla_attention.py times GPU kernels: run it on a CUDA machine")
    swept = sweep(args) if args.sweep else None
    results = [case("packed", args, t) for t in args.tokens] + [case("shared", args, args.prefix)]
    print(f"{'case':>7} {'tokens':>7} {'prefix':>6} {'flash ms':>9} {'sdpa ms':>9} {'x':>5} "
          f"{'flash TF/s':>10} {'sdpa TF/s':>10} {'peak GiB flash/sdpa':>20}")
    for r in results:
        print(f"{r['case']:>7} {r['tokens']:>7} {r['prefix']:>6} {r['flash_ms']:>9.2f} {r['sdpa_ms']:>9.2f} "
              f"{r['speedup']:>5.2f} {r['flash_tflops']:>10.1f} {r['sdpa_tflops']:>10.1f} "
              f"{r['flash_peak_gib']:>9.2f}/{r['sdpa_peak_gib']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
                       "sweep": swept}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
