"""Which SFT recipe teaches a policy to copy? The agentic warm start's SFT (learner.sft_*) in-process, with
held-out teacher-forced accuracy every --every steps: of all loss tokens and of the digit tokens, which carry
each env's answer (the value read off a screenshot, the numbers of a product, the codes of a trail). A
policy that has not learned to copy guesses digits at about 0.1 while every other token is right.

    python experiments/agent_sft_probe.py NAME --envs S,P,L --steps 300 --lr 3e-3 --batch 32 [--device cuda]
        [--set key.path=value ...] [--save DIR]     # DIR: the policy at the latest evaluation (HF, fp32)
        [--careless 0.5]                            # the oracle errs half the time (a warm start's last phase)
        [--careless S=0.8,P=0.8,L=0.5]              # ... at a rate per env

The demonstrations are examples/agent_from_scratch.yaml's oracle episodes (split train; the held-out ones of
split test), collected once into --cache with sandbox.backend=none (the tools run unsandboxed), so they are
the job's tokens exactly. Prints one line per evaluation and writes NAME.json beside --cache.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pickle
import random
import time
from pathlib import Path

import torch

from k3rl.config.job import JobConfig
from k3rl.config.learner import SftPhase
from k3rl.learner.trainer import Trainer
from k3rl.model.checkpoint import save_hf
from k3rl.rollout.episode import make_template
from k3rl.rollout.job_start import collect_demonstrations, phase_config

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "agent_from_scratch.yaml"
IDS = {"S": "k3rl/ScreenRead-v0", "P": "k3rl/PythonTool-v0", "L": "k3rl/LongHorizon-v0"}


def careless_rates(spec: str) -> dict[str, float]:
    """--careless: "0.5" (every env) or "S=0.8,P=0.8,L=0.5" (per env) -> {env id: oracle_mistakes}."""
    if "=" not in spec:
        return {i: float(spec) for i in IDS.values() if float(spec)}
    return {IDS[k.strip()]: float(v) for k, v in (p.split("=") for p in spec.split(",")) if float(v)}


def demonstrations(base: JobConfig, cache: Path, split: str, n: int, careless: dict[str, float] | None = None) -> list:
    """`n` oracle episodes of split `split`, cached; `careless` {env id: q}: that env's oracle errs with
    probability q (its `oracle_mistakes`), as in a warm start's last, careless phase."""
    careless = careless or {}
    rates = set(careless.values())
    tag = ("" if not careless else f"-careless{rates.pop():g}" if len(rates) == 1 and len(careless) == len(IDS)
           else "-careless" + "_".join(f"{e.split('/')[1][0]}{q:g}" for e, q in sorted(careless.items())))
    path = cache / f"demos-{split}-{n}-seed{base.learner.seed}{tag}.pkl"
    if not path.exists():
        phase = SftPhase(from_step=0, env_kwargs={"split": split},
                         env_kwargs_by_env={e: {"oracle_mistakes": q} for e, q in careless.items()})
        cfg = phase_config(base, phase)
        demos = collect_demonstrations(cfg, f"probe-{split}", n)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(demos))
        os.replace(tmp, path)
    return pickle.loads(path.read_bytes())


def accuracy(trainer: Trainer, test: list, digits: set[int]) -> dict[str, dict[str, float]]:
    """Per env: the share of loss tokens (and of digit tokens) whose teacher-forced probability is over 1/2."""
    counts = collections.defaultdict(lambda: [0, 0, 0, 0])
    for d, lp in zip(test, trainer.logprobs(test), strict=True):
        c = counts[d.env_id]
        for t, m, logp in zip(d.completion_ids, d.loss_mask, lp, strict=True):
            if m:
                right = logp > math.log(0.5)
                c[0] += right
                c[1] += 1
                if t in digits:
                    c[2] += right
                    c[3] += 1
    return {env: {"tokens": c[0] / max(1, c[1]), "digits": c[2] / max(1, c[3])} for env, c in sorted(counts.items())}


def profile(trainer: Trainer, batch, steps: int, device: str) -> None:
    """Where an SFT step's time goes: the ops by self time (CPU and device) over `steps` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):  # compile, autotune, allocate
        trainer.sft_step(batch())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            m = trainer.sft_step(batch())
            print(f"step {m['step_time_s']:.2f}s tokens {m['tokens']:.0f} micro-batches {m['micro_batches']:.0f} "
                  f"{m['tokens_per_s']:.0f} tok/s", flush=True)
    for key in ["self_cpu_time_total"] + (["self_device_time_total"] if len(acts) > 1 else []):
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--envs", default="S,P,L", help="S ScreenRead, P PythonTool, L LongHorizon")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--episodes", type=int, default=1024, help="training demonstrations (all envs)")
    ap.add_argument("--set", action="append", default=[], help="key.path=value on the config")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/agent_sft_probe"))
    ap.add_argument("--save", type=Path)
    ap.add_argument("--careless", default="0", help="train on demonstrations whose oracle errs with this probability "
                    "(one for every env, or per env: S=0.8,P=0.8,L=0.5)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop (evaluate, save) after this many seconds of SFT")
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps (after 2 warm-up steps), print, exit")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.cache.mkdir(parents=True, exist_ok=True)
    base = JobConfig.load(CONFIG, ["sandbox.backend=none", "learner.sft_phases=[]", f"learner.sft_steps={a.steps}",
                                   f"learner.sft_lr={a.lr}", *a.set])
    keep = {IDS[e] for e in a.envs.split(",")}
    train = [d for d in demonstrations(base, a.cache, "train", a.episodes, careless_rates(a.careless)) if d.env_id in keep]
    test = demonstrations(base, a.cache, "test", 96)
    tok = make_template(base).tok
    digits = {i for i in range(base.model.k3_config().vocab_size) if tok.decode([i]).strip().isdigit()}
    trainer = Trainer.from_job(base, device=a.device)
    rng = random.Random(base.learner.seed)
    if a.profile:
        return profile(trainer, lambda: rng.sample(train, min(a.batch, len(train))), a.profile, a.device)
    log, t0 = [], time.time()
    for step in range(1, a.steps + 1):
        m = trainer.sft_step(rng.sample(train, min(a.batch, len(train))))
        out_of_time = a.budget_s and time.time() - t0 > a.budget_s
        if step % a.every == 0 or step == a.steps or out_of_time:
            acc = accuracy(trainer, test, digits)
            log.append({"step": step, "loss": m["loss"], "s": time.time() - t0, "accuracy": acc})
            print(f"[{a.name}] step {step} loss {m['loss']:.3f} {time.time() - t0:.0f}s  " + " | ".join(
                f"{e.split('/')[1][:6]} tok {v['tokens']:.3f} dig {v['digits']:.2f}" for e, v in acc.items()), flush=True)
        if log and log[-1]["step"] == step:  # the latest policy and log survive a kill
            if a.save:
                save_hf(trainer.model, a.save)
            (a.cache / f"{a.name}.json").write_text(json.dumps(
                {"args": vars(a) | {"cache": str(a.cache), "save": str(a.save)}, "log": log}, indent=1))
        if out_of_time:
            print(f"[{a.name}] out of time (--budget-s {a.budget_s:g}) after step {step} of {a.steps}", flush=True)
            break


if __name__ == "__main__":
    main()
