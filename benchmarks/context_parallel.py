"""KCP's per-rank work: the widened single call against a second pass, forward + backward.

What one rank computes besides plain ``chunk_kda`` on its tokens, three ways:
  plain      chunk_kda(q, k, v) on the part: no context parallelism (the floor)
  widened    kcp_chunk_kda's way: one call with v widened to [v | 0] and the carried-in fragment
             starting from [0 | I] (K more value columns give P_t and M in the same pass)
  two-pass   the part from a zero state (S~), kda_transition for M, then the part again with
             the entering state (what re-running would cost)
No process group: the collective is one all-gather of [H, K, K + V] per rank and is not timed.

    .venv/bin/python benchmarks/context_parallel.py --tokens 1024 --heads 2 --dim 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3rl.kernels.kda import chunk_kda, kda_transition


def _inputs(T, H, K, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K),
             beta=torch.rand(1, T, H, generator=gen).to(device))  # fmt: skip
    return {n: t.requires_grad_(True) for n, t in x.items()}


def _kw(H, K):
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))  # fmt: skip


def plain(x, S_in, kw):
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return o.sum()


def widened(x, S_in, kw):
    H, K, V = x["q"].shape[2], x["q"].shape[3], x["v"].shape[3]
    v_wide = torch.cat([x["v"], x["v"].new_zeros(*x["v"].shape[:3], K)], dim=-1)
    S0 = torch.cat([torch.zeros(1, H, K, V), torch.eye(K).expand(1, H, K, K)], dim=-1)
    o_wide, S_wide = chunk_kda(x["q"], x["k"], v_wide, x["g"], x["beta"], initial_state=S0,
                               output_final_state=True, **kw)  # fmt: skip
    o, P = o_wide.split([V, K], dim=-1)
    o = o + torch.einsum("bthk,hkv->bthv", P, S_in)
    return o.sum() + S_wide.sum()


def two_pass(x, S_in, kw):
    _, S_loc = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, **kw)
    gate = {
        n: kw[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "lower_bound", "A_log", "dt_bias")
    }
    M = kda_transition(x["k"], x["g"], x["beta"], **gate)
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=S_in.unsqueeze(0), **kw)
    return o.sum() + S_loc.sum() + M.sum()


def _time(fn, x, S_in, kw, reps):
    times = []
    for _ in range(reps + 1):
        for t in x.values():
            t.grad = None
        t0 = time.perf_counter()
        fn(x, S_in, kw).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of one rank's part")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64, help="d_k = d_v")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    T, H, K = args.tokens, args.heads, args.dim
    x = _inputs(T, H, K, "cpu")
    S_in = 0.1 * torch.randn(H, K, K)
    kw = _kw(H, K)
    base = None
    for name, fn in (("plain", plain), ("widened", widened), ("two-pass", two_pass)):
        t = _time(fn, x, S_in, kw, args.reps)
        base = base or t
        print(f"{name:9s} fwd+bwd {t * 1e3:8.1f} ms  x{t / base:.2f}")


if __name__ == "__main__":
    main()
