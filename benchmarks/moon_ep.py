"""MoonEP against plain expert parallelism: per-rank load and one EP forward + backward (CPU, gloo).

    .venv/bin/python benchmarks/moon_ep.py [--checkpoint DIR] [--out benchmarks/results/moon_ep.md]

1. Load. Routed rows each rank computes, max / mean over ranks (1.00 = perfect balance), plain EP
   against MoonEP with `slots` redundant experts a rank, planned two ways: from the previous
   step's routes (a fresh sample of the same distribution: the histogram is one step stale, as
   with `replan` once a step), and from the measured step's own routes (`plan_per_batch`, the
   report's way). For each, the smallest capacity margin with no dropped route this step:
   max over rank pairs of rows / (max_r load_r S k).
   - Zipf: expert popularity p_e ~ 1 / rank(e)^s (experts shuffled over ranks), k distinct experts
     a token (Gumbel top-k), S tokens a rank; at K3's shape (896 experts, k = 16) and a small one.
   - k3-tiny: the routes of a real forward (8 experts, k = 2, every MoE layer) on this repository's
     README, split over ranks by contiguous tokens; the demo's trained checkpoint when one is found
     under runs/ (or --checkpoint), else random weights.
2. Time. One forward + backward of the routed experts alone with ep = 2 gloo processes of one
   thread each, plain EP against MoonEP (both plans), on uniform and Zipf-skewed routes; median
   of 5 after 2 warm-ups, wall time and each rank's CPU time. CPU gloo timing is not GPU NCCL
   timing: it shows the straggler effect of the busiest rank and what MoonEP's extra work
   costs here (counts all-gather, planning in Python, the weight fetch), nothing about NVLink
   or grouped GEMMs; on a shared machine the wall time also carries other processes' load.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after an installed k3rl: spawned children must not find the bare k3rl/ first

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from k3rl.cluster import free_port  # noqa: E402
from k3rl.learner.expert_parallel import ExpertParallelExperts  # noqa: E402
from k3rl.learner.moon_ep import MoonEPExperts, plan_redundant_experts, rank_loads, route_destinations  # noqa: E402
from k3rl.model import K3Config  # noqa: E402
from k3rl.model.moe import RoutedExperts  # noqa: E402


def zipf_routes(E: int, k: int, tokens: int, s: float, seed: int, perm_seed: int = 0) -> torch.Tensor:
    """[tokens, k] distinct experts a token, expert popularity ~ 1 / rank^s (Gumbel top-k)."""
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(perm_seed))
    logp = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[perm]
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(tokens, E, generator=g, dtype=torch.float64)))
    return torch.topk(logp + gumbel, k, dim=1).indices


def _counts(routes: list[torch.Tensor], E: int) -> torch.Tensor:
    return torch.stack([torch.bincount(r.reshape(-1), minlength=E) for r in routes])


def balance(plan_routes: list[torch.Tensor], step_routes: list[torch.Tensor], E: int, ep: int, slots: int):
    """max/mean rows for one step's routes: plain EP, MoonEP planned on the previous step, MoonEP
    planned on this step; and for each plan the smallest drop-free margin."""
    counts = _counts(step_routes, E)
    plain = rank_loads(step_routes, plan_redundant_experts(counts.sum(0), ep, 0)).double()
    out = [(plain.max() / plain.mean()).item()]
    for hist in (_counts(plan_routes, E).sum(0), counts.sum(0)):
        plan = plan_redundant_experts(hist, ep, slots)
        moon = rank_loads(step_routes, plan).double()
        pairs = [torch.bincount(route_destinations(r, plan, counts, s)[2], minlength=ep)
                 for s, r in enumerate(step_routes)]  # fmt: skip
        margin = int(torch.stack(pairs).max()) / (max(plan.load) * step_routes[0].numel())
        out += [(moon.max() / moon.mean()).item(), margin]
    return out


def _cells(balanced: list[float]) -> str:
    """max/mean loads with 3 decimals, margins (the 3rd and 5th values) with 2."""
    return " | ".join(f"{v:.2f}" if i in (2, 4) else f"{v:.3f}" for i, v in enumerate(balanced))


def zipf_table(lines: list[str]) -> None:
    lines += ["| E, k | ep | S | Zipf s | slots | plain EP | MoonEP, last step's plan | margin | MoonEP, "
              "plan per batch | margin |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for E, k, ep, S in [(64, 8, 8, 1024), (896, 16, 8, 1024), (896, 16, 64, 256)]:
        for s in (0.8, 1.2):
            prev = [zipf_routes(E, k, S, s, seed=1000 + r) for r in range(ep)]
            step = [zipf_routes(E, k, S, s, seed=2000 + r) for r in range(ep)]
            for slots in sorted({1, 2, E // ep}):
                lines.append(f"| {E}, {k} | {ep} | {S} | {s} | {slots} | {_cells(balance(prev, step, E, ep, slots))} |")
            print(lines[-1], flush=True)


def k3_tiny_routes(checkpoint: str | None) -> tuple[torch.Tensor, str]:
    """[T, n_moe_layers, k] experts used by k3-tiny on the README, and where the weights came from."""
    from k3rl.model import build_model
    from k3rl.tokenizer import ByteTokenizer

    if checkpoint is None:
        found = [d / (d / "latest").read_text().strip() / "model" for d in ROOT.glob("runs/*/checkpoints")
                 if (d / "latest").is_file()]  # fmt: skip
        found = sorted((d for d in found if (d / "config.json").is_file()), key=lambda d: d.stat().st_mtime)
        checkpoint = str(found[-1]) if found else None
    model = build_model("k3-tiny", seed=0, checkpoint=checkpoint).eval()
    ids = torch.tensor([ByteTokenizer().encode((ROOT / "README.md").read_text())[:4096]])
    with torch.no_grad():
        _, routes = model(ids, return_routing=True)
    source = f"k3-tiny from {Path(checkpoint).resolve().relative_to(ROOT)}" if checkpoint else "k3-tiny, random init"
    return routes[0], source


def k3_tiny_table(lines: list[str], checkpoint: str | None) -> None:
    routes, source = k3_tiny_routes(checkpoint)
    T, n_layers, _ = routes.shape
    half = T // 2  # the first half makes the plan, the second half is the measured step
    lines += [f"{source}, {T} tokens ({half} make the plan, {T - half} measured)", "",
              "| ep | slots | layer | plain EP | MoonEP, last step's plan | margin | MoonEP, plan per batch | margin |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ep, slots in [(2, 1), (4, 1), (4, 2)]:
        for layer in range(n_layers):
            prev = list(routes[:half, layer].chunk(ep))
            step = list(routes[half : half + (T - half) // ep * ep, layer].chunk(ep))
            lines.append(f"| {ep} | {slots} | {layer} | {_cells(balance(prev, step, 8, ep, slots))} |")
        print(lines[-1], flush=True)


# -- timing -----------------------------------------------------------------------------------

TIME_E, TIME_K, TIME_S, TIME_LAT, TIME_F, TIME_SLOTS = 16, 4, 2048, 128, 256, 2


def _time_worker(rank: int, world: int, port: int, zipf_s: float, queue) -> None:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = K3Config.model_validate({**K3Config.preset("k3-tiny").model_dump(), "num_experts": TIME_E,
                                       "moe_intermediate_size": TIME_F, "routed_expert_hidden_size": TIME_LAT})  # fmt: skip
        torch.manual_seed(0)
        experts = RoutedExperts(cfg)
        for w in (experts.w1, experts.w3, experts.w2):
            torch.nn.init.normal_(w, std=0.05)
        idx = zipf_routes(TIME_E, TIME_K, TIME_S, zipf_s, seed=3000 + rank)
        g = torch.Generator().manual_seed(rank)
        z, p = torch.randn(TIME_S, TIME_LAT, generator=g), torch.rand(TIME_S, TIME_K, generator=g)
        plain = ExpertParallelExperts(experts, dist.group.WORLD)
        moon = MoonEPExperts(experts, dist.group.WORLD, TIME_SLOTS, TIME_S, margin=1.25, allow_drops=True)
        batch = MoonEPExperts(experts, dist.group.WORLD, TIME_E // world, TIME_S, margin=1.25, allow_drops=True,
                              plan_per_batch=True)  # fmt: skip
        with torch.no_grad():  # the previous step's routes make the plan
            moon(z, zipf_routes(TIME_E, TIME_K, TIME_S, zipf_s, seed=4000 + rank), p)
        moon.replan()
        moon.dropped_routes.zero_()
        runs = {"plain": [], "moon": [], "batch": []}
        for _ in range(7):  # alternating, so that load from other processes hits all alike
            for name, layer in (("plain", plain), ("moon", moon), ("batch", batch)):
                x = z.clone().requires_grad_(True)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                layer(x, idx, p).sum().backward()
                c1 = time.process_time()
                dist.barrier()
                runs[name].append((time.perf_counter() - t0, c1 - c0))
                layer.zero_grad(set_to_none=True)
        times = {name: tuple(statistics.median(v[i] for v in r[2:]) for i in (0, 1)) for name, r in runs.items()}
        every = [zipf_routes(TIME_E, TIME_K, TIME_S, zipf_s, seed=3000 + r) for r in range(world)]
        rows = {"plain": rank_loads(every, plan_redundant_experts(torch.ones(TIME_E), world, 0)).tolist(),
                "moon": rank_loads(every, moon.plan).tolist(), "batch": rank_loads(every, batch.plan).tolist()}
        dropped = {"moon": int(moon.dropped_routes), "batch": int(batch.dropped_routes)}
        queue.put((rank, times, rows, dropped, {"moon": moon.capacity(TIME_K), "batch": batch.capacity(TIME_K)}))
    finally:
        dist.destroy_process_group()


def time_table(lines: list[str]) -> None:
    lines += ["| Zipf s | layer | wall s / step | CPU s / step, each rank | rows each rank computes | capacity a pair "
              "| routes dropped |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    world = 2
    for s in (0.0, 1.2):
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_time_worker, args=(r, world, port, s, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        out = sorted(queue.get(timeout=600) for _ in range(world))
        for proc in procs:
            proc.join()
        names = {"plain": "plain EP", "moon": f"MoonEP, last step's plan, {TIME_SLOTS} slots",
                 "batch": f"MoonEP, plan per batch, {TIME_E // world} slots"}  # fmt: skip
        for k, name in names.items():
            wall = max(o[1][k][0] for o in out)
            cpu = " / ".join(f"{o[1][k][1]:.3f}" for o in out)
            rows = " / ".join(map(str, out[0][2][k]))
            cap = out[0][4].get(k, TIME_S * TIME_K)  # plain EP: up to S k rows a pair
            drops = sum(o[3].get(k, 0) for o in out)
            lines.append(f"| {s} | {name} | {wall:.3f} | {cpu} | {rows} | {cap} | {drops} |")
            print(lines[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None, help="a k3-tiny HF-layout directory (default: the newest demo run's)")
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [f"# MoonEP {stamp}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}", "", "## Load: Zipf routing", ""]  # fmt: skip
    zipf_table(lines)
    lines += ["", "## Load: k3-tiny", ""]
    k3_tiny_table(lines, args.checkpoint)
    lines += ["", f"## Time: ep = 2 gloo processes, E = {TIME_E}, k = {TIME_K}, S = {TIME_S}, latent {TIME_LAT}, "
              f"expert width {TIME_F}, margin 1.25 (CPU: not GPU NCCL timing)", ""]  # fmt: skip
    time_table(lines)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
