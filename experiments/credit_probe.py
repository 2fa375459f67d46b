"""Credit assignment on the demo's task, in one process: a recipe's RL steps and held-out evals.

    python experiments/credit_probe.py NAME examples/demo_from_scratch.yaml [key.path=value ...]
    python experiments/credit_probe.py --plot OUT.png A.jsonl B.jsonl ...
    python experiments/credit_probe.py --table A.jsonl B.jsonl ...     # RL's own gain and evals, a line each

With the job's own parts (config, episode loop, embedded engine, the learner's Trainer and weight
export; no Ray or MLflow): an SFT warm start (cosine over learner.sft_steps; WS_CACHE=path.pt saves
it, and loads it when the file exists, so several recipes start from the same policy), then
learner.steps GRPO steps, each on rollout.prompts_per_step x group_size fresh episodes, and every
EVAL_EVERY (default 10) steps a held-out eval on NEVAL (default 64) tasks of seeds training never draws, greedy and at
the job's temperature. The SFT follows learner.sft_phases as the job does (e.g. careful demonstrations, then
a careless oracle's: `'learner.sft_phases=[{from_step: 100, env_kwargs: {oracle_wrong_key: 0.5}}]'`, what
session 11's SFT_SWITCH=100 CARELESS_Q=0.5 did). SFT_TARGET_NLL=x ends the warm start early, once the mean NLL of the
last 5 SFT steps is below x (at most learner.sft_steps). Writes NAME.jsonl (one line per SFT / step / eval event). The measurement
in docs/learning.md ("Per-turn credit") used it; its runs are in experiments/results/credit/.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import sys
import time

import torch


def plot(out: str, files: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for f in files:
        rows = [json.loads(line) for line in open(f)]
        name = os.path.basename(f).removesuffix(".jsonl")
        steps = [r for r in rows if r["event"] == "step"]
        evals = [r for r in rows if r["event"] == "eval"]
        a.plot([r["step"] for r in steps], [r["reward"] for r in steps], label=name)
        b.plot([r["step"] for r in evals], [r["g_succ"] for r in evals], marker="o", label=name)
    a.set(title="training reward (sampled)", xlabel="RL step")
    b.set(title="held-out greedy success", xlabel="RL step", ylim=(0, 1))
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(files: list[str]) -> None:
    """One line per run: RL's own gain (mean training reward of the last 5 steps minus the first 5)
    and the held-out evals (greedy success, sampled success)."""
    for f in files:
        rows = [json.loads(line) for line in open(f)]
        rewards = [r["reward"] for r in rows if r["event"] == "step"]
        evals = " ".join(f"{r['step']}:{r['g_succ']:.2f}/{r['t_succ']:.2f}" for r in rows if r["event"] == "eval")
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        gain = f"{first:.3f} -> {last:.3f} ({last - first:+.3f})" if len(rewards) >= 10 else "-"
        print(f"{os.path.basename(f).removesuffix('.jsonl')}: {len(rewards)} steps, reward steps 1-5 -> last 5 {gain}; "
              f"eval step:greedy/sampled success {evals}")


def probe(name: str, config: str, overrides: list[str]) -> None:
    from k3rl.config import JobConfig
    from k3rl.learner.trainer import Trainer
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.episode import EpisodeSpec, job_sampling, make_env, make_template, run_episode
    from k3rl.rollout.job_start import collect_demonstration_sets
    from k3rl.rollout.scheduler import episode_specs

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_eval = int(os.environ.get("NEVAL", 64))
    cfg = JobConfig.load(config, overrides)
    out = open(f"{name}.jsonl", "w")
    t0 = time.time()

    def log(**kw):
        kw["t"] = time.time() - t0
        out.write(json.dumps(kw) + "\n")
        out.flush()
        print(kw, flush=True)

    torch.manual_seed(cfg.learner.seed)
    trainer = Trainer.from_job(cfg, device=device)
    template, sampling = make_template(cfg), job_sampling(cfg)
    engine = EmbeddedEngine(copy.deepcopy(trainer.model).eval())

    async def generate(ids, params, images=None, key=None, group_key=None):
        return await engine.agenerate(ids, params, images=images)

    def episodes(specs, params):
        async def run():
            return await asyncio.gather(*(run_episode(lambda s=s: make_env(s, cfg, template), s, generate, template, params,
                                                      max_turns=cfg.envs.max_turns,
                                                      max_context_tokens=cfg.rollout.max_context_tokens)
                                          for s in specs))
        return asyncio.run(run())

    def evaluate(step):
        env = cfg.envs.train[0]
        specs = [EpisodeSpec(id=f"e{i}", env_id=env.id, seed=2**31 + i, env_kwargs=env.kwargs) for i in range(n_eval)]
        row = {}
        for tag, temperature in (("g", 0.0), ("t", cfg.rollout.sampling.temperature)):
            ts = episodes(specs, sampling.model_copy(update={"temperature": temperature}))
            row[tag + "_succ"] = sum(t.reward >= 1.0 for t in ts) / n_eval
            row[tag + "_rew"] = sum(t.reward for t in ts) / n_eval
            row[tag + "_fmt"] = sum(t.metadata.get("parse_errors", 0) > 0 for t in ts) / n_eval
        log(event="eval", step=step, **row)

    cache = os.environ.get("WS_CACHE")
    if cache and os.path.exists(cache):
        trainer.model.load_state_dict(torch.load(cache, map_location=device))
        trainer.reset_reference()
        log(event="warm_start_loaded", path=cache)
    elif cfg.learner.sft_steps:
        demo_sets = collect_demonstration_sets(cfg, name, cfg.learner.sft_episodes)  # learner.sft_phases: later sets
        starts = [p.from_step for p in cfg.learner.sft_phases]
        rng = random.Random(cfg.learner.seed)
        size = cfg.learner.sft_batch or cfg.rollout.prompts_per_step * cfg.rollout.group_size
        target, recent = float(os.environ.get("SFT_TARGET_NLL", 0)), []
        for i in range(cfg.learner.sft_steps):
            pool = demo_sets[sum(i >= s for s in starts)]
            m = trainer.sft_step(rng.sample(pool, k=min(size, len(pool))))
            recent = (recent + [m["nll"]])[-5:]
            if (i + 1) % 25 == 0:
                log(event="sft", step=i + 1, nll=m["nll"])
            if target and len(recent) == 5 and sum(recent) / 5 < target:  # the warm start by its state
                log(event="sft_stop", step=i + 1, nll_mean5=sum(recent) / 5)
                break
        trainer.reset_reference()
        if cache:
            torch.save(trainer.model.state_dict(), cache)
    engine.update_weights(trainer.export_weights(1))
    evaluate(0)
    P = cfg.rollout.prompts_per_step
    for step in range(1, cfg.learner.steps + 1):
        specs = [EpisodeSpec(**{k: v for k, v in s.items() if k in EpisodeSpec.__dataclass_fields__})
                 for g in range((step - 1) * P, step * P) for s in episode_specs(cfg, name, g, step)]
        ts = [t for t in episodes(specs, sampling) if not t.error and any(t.loss_mask)]
        m = trainer.train_step(ts)
        engine.update_weights(trainer.export_weights(step + 1))
        n = max(1, len(ts))
        log(event="step", step=step, reward=sum(t.reward for t in ts) / n, succ=sum(t.reward >= 1 for t in ts) / n,
            n=len(ts), fmt=sum(t.metadata.get("parse_errors", 0) > 0 for t in ts) / n, clip=m["clip_frac"],
            kl=m["kl"], approx_kl=m["approx_kl"], ent=m["entropy"])
        if step % int(os.environ.get("EVAL_EVERY", 10)) == 0 or step == cfg.learner.steps:
            evaluate(step)
    engine.close()
    log(event="done")


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "--table":
        table(sys.argv[2:])
    else:
        probe(sys.argv[1], sys.argv[2], sys.argv[3:])
