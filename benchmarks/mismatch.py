"""Train-inference mismatch: the engine's log-probs of its own sampled tokens against the learner's.

    python benchmarks/mismatch.py                                   # CPU, k3-tiny (fp32 and bf16)
    python benchmarks/mismatch.py --checkpoint runs/demo/checkpoints/step-000030/model
    python benchmarks/mismatch.py --preset k3-small --device cuda --sft-steps 30    # one GPU, bf16

The engine (`EmbeddedEngine`: chunked prefill, graph decode over the state pool, prefix cache
across turns) plays real multi-turn KeyLookup episodes (examples/demo_from_scratch.yaml's env); every
sampled token comes back with its fp32 log-prob log mu. The learner then scores the same
tokens with its own forward (packed sequences through the chunk kernels, fp32 master weights,
under bf16 autocast for the bf16 modes, routing replay of the engine's experts as in the job):
log pi. With d = log pi - log mu per generated token,

    mean |d|, max |d|
    k1 = mean(-d)               = E_mu[log mu - log pi]                 estimates KL(mu || pi)
    k3 = mean(exp(d) - 1 - d)   = E_mu[r - 1 - log r],  r = pi / mu      the same KL, >= 0 per token

split by position: all generated tokens, those of the first assistant message (`turn 1`), and
those of later messages, which follow a tool output (`later`).

With bf16 two more rows put the numbers in scale: the engine against the exact (fp32) learner,
and the bf16 floor, the bf16 learner against the fp32 learner on the same tokens (no engine
involved): how far bf16 rounding alone moves the learner's own log-probs. (On CUDA the fp32
learner's KDA runs the PyTorch chunk reference: see `kda_backend`.)

Engine modes (the learner side never changes):
    fp32       an fp32 engine (the CPU job's setting)
    bf16       bf16 weights (model.dtype: bfloat16, the GPU job's setting), prefix cache on
    reprefill  bf16, prefix_cache_size 0: every turn's prompt is prefilled whole by the chunk
               kernels instead of continuing the state decoded in the earlier turns
    autocast   the learner's own precision: fp32 weights under bf16 autocast
               (`EmbeddedEngine(..., autocast_dtype=torch.bfloat16)`)
Each mode also reports its engine speed: generated tokens/s over the timed episodes (the second
of two equal sets: the first compiles kernels and captures graphs; both sets are scored), and of
decode alone (`decode_speed`: a batch of requests of 128 tokens after 128-token prompts).

`--long` adds synthetic two-turn requests at long contexts (random prompt of L tokens, a reply,
a random 'tool output' of 256 tokens, a second reply): contexts that KeyLookup episodes never
reach, for a warm-started or a random-init model alike.

On the GPU image (torch + triton only) carry .whl and .whl_rl (benchmarks/device_wheels.sh):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl_rl/*.whl
    export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import importlib.util
import math
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after an installed k3rl: spawned children must not find the bare k3rl/ first


def import_k3rl_in_place() -> None:
    """Without an install of k3rl, map its subpackages to the repository's folders (k3rl.rollout ->
    rollout/, ...) and skip k3rl.rollout's __init__, which imports the Ray pool."""
    import types

    import k3rl

    if importlib.util.find_spec("k3rl.rollout") is not None:
        return
    k3rl.__path__.append(ROOT)
    bare = types.ModuleType("k3rl.rollout")
    bare.__path__ = [os.path.join(ROOT, "rollout")]
    sys.modules["k3rl.rollout"] = bare


import_k3rl_in_place()
from k3rl.config import JobConfig  # noqa: E402
from k3rl.learner.data import build_micro_batches  # noqa: E402
from k3rl.learner.distill import per_completion  # noqa: E402
from k3rl.model import build_model  # noqa: E402
from k3rl.rollout.engine import EmbeddedEngine  # noqa: E402
from k3rl.rollout.episode import EpisodeSpec, job_limits, job_sampling, make_env, make_template, run_episode  # noqa: E402
from k3rl.rollout.job_start import collect_demonstrations  # noqa: E402
from k3rl.types import SamplingParams, Trajectory  # noqa: E402

SPLITS = ("all", "turn 1", "later")


# ----- statistics ---------------------------------------------------------------------------------
def mismatch_stats(learner: torch.Tensor, engine: torch.Tensor) -> dict[str, float]:
    """Per-token log-probs of the same tokens, learner (pi) and engine (mu): d = log pi - log mu.
    Returns tokens, mean |d|, max |d|, k1 = mean(-d) and k3 = mean(exp(d) - 1 - d) (both estimate
    KL(mu || pi) from tokens sampled by mu), computed in fp64."""
    learner, engine = torch.as_tensor(learner, dtype=torch.float64), torch.as_tensor(engine, dtype=torch.float64)
    if learner.shape != engine.shape:
        raise ValueError(f"learner and engine log-probs must pair up; got {tuple(learner.shape)} and "
                         f"{tuple(engine.shape)}")
    if learner.numel() == 0:
        return {"tokens": 0, "mean_abs": math.nan, "max_abs": math.nan, "k1": math.nan, "k3": math.nan}
    d = learner - engine
    return {"tokens": d.numel(), "mean_abs": d.abs().mean().item(), "max_abs": d.abs().max().item(),
            "k1": (-d).mean().item(), "k3": torch.expm1(d).sub(d).mean().item()}


def split_positions(t: Trajectory) -> dict[str, list[int]]:
    """Indices into t.completion_ids of its generated tokens: all, the first assistant message's
    (before anything the env said), and the later ones (after a tool output or env message)."""
    generated = [j for j, m in enumerate(t.loss_mask) if m]
    first_env = next((j for j, m in enumerate(t.loss_mask) if not m), len(t.loss_mask))
    return {"all": generated, "turn 1": [j for j in generated if j < first_env],
            "later": [j for j in generated if j > first_env]}


def report(trajectories: list[Trajectory], learner_lp: list[torch.Tensor],
           reference: list[torch.Tensor] | None = None) -> dict[str, dict[str, float]]:
    """mismatch_stats per split over all trajectories: `learner_lp` against the engine's log-probs
    (or against `reference`, another scoring of the same completions)."""
    out = {}
    for split in SPLITS:
        pi, mu = [], []
        for i, (t, lp) in enumerate(zip(trajectories, learner_lp, strict=True)):
            idx = split_positions(t)[split]
            pi += lp[idx].tolist()
            mu += reference[i][idx].tolist() if reference is not None else [t.logprobs[j] for j in idx]
        out[split] = mismatch_stats(torch.tensor(pi), torch.tensor(mu))
    return out


@contextlib.contextmanager
def kda_backend(model, backend: str | None):
    """The KDA layers on `backend` for a while (None: as they are). The fp32 learner on CUDA takes the
    PyTorch chunk reference: the Triton chunk kernel asks for more shared memory in fp32 at head dim 128
    than an H200 has (294,912 bytes of 232,448)."""
    from k3rl.model.kda import KimiDeltaAttention

    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)] if backend else []
    before = [m.backend for m in layers]
    for m in layers:
        m.backend = backend
    try:
        yield
    finally:
        for m, b in zip(layers, before, strict=True):
            m.backend = b


def comparisons(model, trajectories: list[Trajectory], bf16: bool) -> list[tuple[str, dict]]:
    """(what, report) rows for one engine's trajectories. The learner in the engine's dtype, with and
    without routing replay; with bf16 also the exact (fp32) learner against the engine, and the bf16
    floor: the bf16 learner against the fp32 learner on the same tokens (no engine involved)."""
    if not bf16:
        return [(f"fp32, {r}", report(trajectories, learner_logprobs(model, trajectories, False, r == "replay")))
                for r in ("replay", "no replay")]
    lp16 = learner_logprobs(model, trajectories, True)
    with kda_backend(model, "torch" if model.lm_head.weight.is_cuda else None):
        lp32 = learner_logprobs(model, trajectories, False)
    return [("bf16 autocast, replay", report(trajectories, lp16)),
            ("bf16 autocast, no replay", report(trajectories, learner_logprobs(model, trajectories, True, False))),
            ("fp32, replay", report(trajectories, lp32)),
            ("floor: bf16 learner vs fp32 learner", report(trajectories, lp16, lp32))]


# ----- the learner's side -------------------------------------------------------------------------
@torch.no_grad()
def learner_logprobs(model, trajectories: list[Trajectory], bf16: bool, replay: bool = True,
                     micro_batch_tokens: int = 16384) -> list[torch.Tensor]:
    """log pi of every completion token (0 where loss_mask is 0), as the trainer's forward computes it:
    packed micro-batches, fp32 weights, bf16 autocast when `bf16`, and with `replay` the experts
    the engine routed each generated token to (positions without a record take the model's own)."""
    device = model.lm_head.weight.device
    n_moe, k = len(model.moe_layer_ids), model.config.num_experts_per_token
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    out: list[torch.Tensor | None] = [None] * len(trajectories)
    mbs = build_micro_batches(trajectories, micro_batch_tokens, "token_mean", num_moe_layers=n_moe if replay else 0,
                              top_k=k)
    for mb in mbs:
        mb = mb.to(device)
        routes = mb.routed_experts
        with autocast:
            if routes is not None:  # as Trainer._replay_routes
                _, own = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, return_routing=True)
                routes = torch.where(routes < 0, own.to(routes.dtype), routes)
            logp, _ = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, routed_experts=routes, targets=mb.targets[None])
        for s, values in per_completion(logp[0], mb, trajectories).items():
            out[s] = values
    return out  # type: ignore[return-value]


# ----- the engine's side --------------------------------------------------------------------------
def make_engine(learner_model, mode: str, max_num_seqs: int) -> EmbeddedEngine:
    """An engine on a copy of the learner's weights in `mode`'s precision."""
    model = copy.deepcopy(learner_model)
    kw = {}
    if mode in ("bf16", "reprefill"):
        model.to_param_dtype(torch.bfloat16)  # what the weight sync sends with model.dtype bfloat16
    elif mode == "autocast":
        kw["autocast_dtype"] = torch.bfloat16
    elif mode != "fp32":
        raise ValueError(f"unknown mode {mode!r}; use fp32, bf16, reprefill or autocast")
    return EmbeddedEngine(model, max_num_seqs=max_num_seqs, prefill_chunk=2048, max_prefill_tokens=16384,
                          prefix_cache_size=0 if mode == "reprefill" else 4 * max_num_seqs, **kw)


async def play(engine: EmbeddedEngine, cfg: JobConfig, episodes: int, first_seed: int) -> list[Trajectory]:
    """`episodes` KeyLookup episodes through the engine, all at once, routes recorded."""
    template = make_template(cfg)
    env = cfg.envs.train[0]

    async def generate(token_ids, sampling, images=None, key=None, group_key=None):
        return await engine.agenerate(token_ids, sampling, images)

    specs = [EpisodeSpec(id=f"mismatch-{first_seed + i}", env_id=env.id, seed=first_seed + i,
                         env_kwargs=dict(env.kwargs)) for i in range(episodes)]
    trajs = await asyncio.gather(*(run_episode(functools.partial(make_env, s, cfg, template), s, generate, template,
                                               job_sampling(cfg), record_routing=True, **job_limits(cfg))
                                   for s in specs))
    failed = [t for t in trajs if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, e.g. {failed[0].id}: {failed[0].error}")
    return list(trajs)


def long_requests(engine: EmbeddedEngine, length: int, n: int, reply: int, tool: int,
                  seed: int) -> list[Trajectory]:
    """n two-turn requests at a context of `length` random tokens: reply, a random tool output, reply."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=reply, return_routed_experts=True)
    prompts = [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]  # bytes: no special tokens
    trajs = [Trajectory(id=f"long-{length}-{i}", env_id="random", prompt_ids=p, routed_experts=[])
             for i, p in enumerate(prompts)]
    for turn in range(2):
        futures = [engine.submit(t.token_ids, params.model_copy(update={"seed": seed * 1000 + 10 * i + turn}))
                   for i, t in enumerate(trajs)]
        for t, f in zip(trajs, futures, strict=True):
            r = f.result()
            t.append(r.token_ids, generated=True, logprobs=r.logprobs, version=r.version, routed=r.routed_experts)
            if turn == 0:
                t.append(torch.randint(0, 256, (tool,), generator=g).tolist(), generated=False)
    return trajs


def decode_speed(engine: EmbeddedEngine, batch: int, prompt: int = 128, tokens: int = 128) -> float:
    """Generated tokens/s of `batch` requests of `tokens` tokens each after a `prompt`-token prompt
    (no stop token, so every request runs to its length); a second run, after one that compiles."""
    prompts = [torch.randint(0, 256, (prompt,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    for _ in range(2):
        t0 = time.monotonic()
        futures = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=tokens, seed=i))
                   for i, p in enumerate(prompts)]
        n = sum(len(f.result().token_ids) for f in futures)
        wall = time.monotonic() - t0
    return n / wall


# ----- the run ------------------------------------------------------------------------------------
def warm_start(model, cfg: JobConfig, steps: int, bf16: bool, device: str):
    """`steps` SFT steps of the trainer on the job's oracle demonstrations (the job's warm start)."""
    from k3rl.learner.trainer import Trainer

    learner = cfg.learner.model_copy(update={"bf16": bf16, "sft_steps": steps, "kl_coef": 0.0})
    trainer = Trainer(model, learner, device=device)
    demos = collect_demonstrations(cfg, "mismatch", cfg.learner.sft_episodes)
    rng = random.Random(0)
    size = min(len(demos), cfg.rollout.prompts_per_step * cfg.rollout.group_size)
    losses = [trainer.sft_step(rng.sample(demos, k=size))["loss"] for _ in range(steps)]
    model.eval()
    return losses


def fmt(r: dict[str, float]) -> str:
    return (f"{r['tokens']:>6} | {r['mean_abs']:.2e} | {r['max_abs']:.2e} | {r['k1']:+.2e} | {r['k3']:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--checkpoint", default=None, help="an HF-layout checkpoint (a warm start)")
    ap.add_argument("--sft-steps", type=int, default=0, help="warm-start by SFT on oracle episodes first")
    ap.add_argument("--modes", default=None, help="engine modes, comma-separated (default: fp32,bf16,reprefill,"
                                                   "autocast on CPU; bf16,reprefill,autocast on CUDA)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per assistant turn (default: the demo's)")
    ap.add_argument("--long", default="", help="long-context lengths, comma-separated (e.g. 2048,8192)")
    ap.add_argument("--long-n", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    modes = (args.modes or ("bf16,reprefill,autocast" if cuda else "fp32,bf16,reprefill,autocast")).split(",")
    overrides = [f"model.preset={args.preset}", f"model.seed={args.seed}"]
    if args.max_tokens:
        overrides.append(f"rollout.sampling.max_tokens_per_turn={args.max_tokens}")
    cfg = JobConfig.load(os.path.join(ROOT, "examples/demo_from_scratch.yaml"), overrides)
    torch.manual_seed(args.seed)
    model = build_model(args.preset, None, seed=args.seed, device=args.device, checkpoint=args.checkpoint)
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"# train-inference mismatch: {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M), "
          f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    start = "checkpoint " + args.checkpoint if args.checkpoint else "random init"
    if args.sft_steps:
        t0 = time.monotonic()
        losses = warm_start(model, cfg, args.sft_steps, bf16=cuda, device=args.device)
        start += f" + {args.sft_steps} SFT steps (loss {losses[0]:.3f} -> {losses[-1]:.3f}, {time.monotonic() - t0:.0f}s)"
    print(f"# weights: {start}; KeyLookup {dict(cfg.envs.train[0].kwargs)}, {args.episodes} episodes, "
          f"{cfg.envs.max_turns} turns x {cfg.rollout.sampling.max_tokens_per_turn} tokens, temperature "
          f"{cfg.rollout.sampling.temperature}", flush=True)
    print("| engine | learner | split | tokens | mean abs d | max abs d | k1 | k3 | engine tok/s: episodes / decode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        bf16 = mode != "fp32"
        try:
            with make_engine(model, mode, max_num_seqs=args.episodes) as engine:
                trajs = asyncio.run(play(engine, cfg, args.episodes, args.seed * 100_000 + 50_000))  # compiles
                t0 = time.monotonic()
                timed = asyncio.run(play(engine, cfg, args.episodes, args.seed * 100_000))
                wall = time.monotonic() - t0
                trajs += timed
                speed = decode_speed(engine, args.episodes)
                long = [t for L in filter(None, args.long.split(","))
                        for t in long_requests(engine, int(L), args.long_n, 64, 256, args.seed)]
        except Exception as e:  # noqa: BLE001 - one mode's failure is reported, the others still run
            print(f"| {mode} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            continue
        generated = sum(sum(t.loss_mask) for t in timed)
        turns = sum(1 for t in trajs for tu in t.turns if tu.role == "assistant") / len(trajs)
        for learner, rep in comparisons(model, trajs, bf16):
            for split, r in rep.items():
                print(f"| {mode} | {learner} | {split} | {fmt(r)} | {generated / wall:,.0f} / {speed:,.0f} |", flush=True)
        for L in filter(None, args.long.split(",")):
            these = [t for t in long if t.id.startswith(f"long-{L}-")]
            for learner, rep in comparisons(model, these, bf16):
                if "no replay" not in learner:
                    for split, r in rep.items():
                        print(f"| {mode} | long {L}: {learner} | {split} | {fmt(r)} | - |", flush=True)
        print(f"# {mode}: {len(trajs)} episodes, {turns:.2f} assistant turns each, reward "
              f"{sum(t.reward for t in trajs) / len(trajs):.3f}; timed: {generated} generated tokens of {len(timed)} "
              f"episodes in {wall:.2f}s; decode alone: {speed:,.0f} tok/s at batch {args.episodes}",
              flush=True)


if __name__ == "__main__":
    main()
