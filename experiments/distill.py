"""On-policy distillation on the CPU: does a k3-tiny student learn KeyLookup faster from a teacher?

    python experiments/distill.py --teacher DIR        # the measurement (experiments/results/distill/runs.md);
                                                      # DIR empty: the teacher is trained and saved there
    python experiments/distill.py --rl-steps 2 --teacher-sft-steps 2 --student-sft-steps 2 --eval-tasks 4 \
        --out /tmp/distill-smoke                                   # a smoke run

In one process, with the job's own parts (the demo's config, examples/demo_from_scratch.yaml: the episode loop,
the embedded engine, the learner's Trainer, its weight export):

1. a teacher: a k3-tiny trained on KeyLookup by SFT on oracle demonstrations (100 steps at 3e-3:
   it copies the key and the value), saved as an HF-layout checkpoint;
2. a student: a fresh k3-tiny with a short SFT warm start at 1e-2 (it learns the message format,
   not the content: docs/learning.md, "The warm start must copy"), or (--student-wrong-key q) a
   longer one on a careless oracle's demonstrations, which look up another key with probability q:
   the student then has every skill and picks the requested key only about 1 - q of the time;
3. from that same student, the same RL budget twice: the demo's RL (per-turn GRPO,
   `turn_grpo_no_std`, on KeyLookup's per-turn rewards) on the env's reward alone, and the same
   plus the teacher's per-token reverse-KL advantage (`learner.distill.teachers`, the teacher
   loaded from its checkpoint by the Trainer), the two arms in lockstep on the same task seeds;
   `--estimator exact` takes the teacher's reverse KL over the whole vocabulary at every sampled
   position (a loss term) instead of through the sampled token.

Per RL step: the training episodes' mean reward, success rate and malformed fraction; every
--eval-every steps the held-out greedy success and reward on --eval-tasks tasks (seeds training
never draws). Writes <out>.json and <out>.png (the curves) after every step, so a run cut short
still compares the arms at equal steps.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

if importlib.util.find_spec("k3rl") is None:  # a checkout without an install (not the device's installed layout)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3rl.config import JobConfig  # noqa: E402
from k3rl.learner.trainer import Trainer  # noqa: E402
from k3rl.metrics import success  # noqa: E402
from k3rl.model import build_model  # noqa: E402
from k3rl.model.checkpoint import save_hf  # noqa: E402
from k3rl.rollout.engine import EmbeddedEngine  # noqa: E402
from k3rl.rollout.episode import EpisodeSpec, job_limits, job_sampling, make_env, make_template, run_episode  # noqa: E402
from k3rl.rollout.job_start import collect_demonstrations  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "demo_from_scratch.yaml")


def sft(model, cfg: JobConfig, demos, steps: int, lr: float, seed: int) -> float:
    """`steps` SFT steps on batches of one RL step's size (what the job's warm start does); the last
    step's NLL per token."""
    learner = cfg.learner.model_copy(update={"sft_steps": steps, "sft_lr": lr, "kl_coef": 0.0})
    trainer = Trainer(model, learner)
    rng = random.Random(seed)
    size = min(len(demos), cfg.rollout.prompts_per_step * cfg.rollout.group_size)
    for i in range(steps):
        m = trainer.sft_step(rng.sample(demos, k=size))
        if i % 10 == 0 or i == steps - 1:
            print(f"  sft step {i + 1}/{steps}: nll {m['nll']:.4f} ({m['step_time_s']:.1f} s)", flush=True)
    return m["nll"]


def play(engine: EmbeddedEngine, cfg: JobConfig, specs: list[EpisodeSpec]):
    """The episodes of `specs`, all at once against the engine (it batches their requests)."""
    template = make_template(cfg)

    async def generate(token_ids, sampling, images=None, key=None, group_key=None):
        return await engine.agenerate(token_ids, sampling, images)

    async def all_of_them():
        return await asyncio.gather(*(run_episode(lambda s=s: make_env(s, cfg, template), s, generate, template,
                                                  job_sampling(cfg), **job_limits(cfg)) for s in specs))

    return asyncio.run(all_of_them())


def train_specs(cfg: JobConfig, step: int, rng: random.Random, version: int) -> list[EpisodeSpec]:
    env = cfg.envs.train[0]
    out = []
    for p in range(cfg.rollout.prompts_per_step):
        gid, seed = f"s{step}-g{p}", rng.randrange(2**31)
        out += [EpisodeSpec(id=f"{gid}-m{k}", env_id=env.id, seed=seed, group_id=gid, env_kwargs=dict(env.kwargs),
                            issued_version=version) for k in range(cfg.rollout.group_size)]
    return out


def evaluate(engine: EmbeddedEngine, cfg: JobConfig, tasks: int) -> dict[str, float]:
    """Greedy success and mean reward on held-out tasks (seeds from 2**31 on: training draws below), and
    the success of one sample per task at the job's temperature (what RL trains)."""
    env = cfg.envs.train[0]
    out = {}
    for tag, temperature in (("eval", 0.0), ("eval_sampled", cfg.rollout.sampling.temperature)):
        specs = [EpisodeSpec(id=f"eval-{i}", env_id=env.id, seed=2**31 + i, env_kwargs=dict(env.kwargs),
                             sampling={"temperature": temperature}) for i in range(tasks)]
        episodes = play(engine, cfg, specs)
        out[f"{tag}_success"] = sum(success(t.reward) for t in episodes) / tasks
        out[f"{tag}_reward"] = sum(t.reward for t in episodes) / tasks
    return out


def evaluate_model(model, cfg: JobConfig, tasks: int) -> dict[str, float]:
    """`evaluate` on an engine of its own holding `model`."""
    engine = EmbeddedEngine(copy.deepcopy(model).eval(), max_num_seqs=64)
    try:
        return evaluate(engine, cfg, tasks)
    finally:
        engine.close()


class Arm:
    """One RL run from the student (with the teacher at `teacher_dir`, if any): its trainer, its engine,
    its task stream (the same seeds in both arms) and the rows of its curve."""

    def __init__(self, student, cfg: JobConfig, steps: int, teacher_dir: str | None, coef: float, clip: float | None,
                 seed: int, discount: float = 0.0, env_coef: float = 1.0, estimator: str = "sampled"):
        teachers = ([{"checkpoint": teacher_dir, "preset": "k3-tiny", "coef": coef, "clip": clip, "discount": discount,
                      "engines": 0, "estimator": estimator}]
                    if teacher_dir else [])
        learner = type(cfg.learner).model_validate({**cfg.learner.model_dump(), "steps": steps,
                                                    "distill": {"teachers": teachers, "env_coef": env_coef}})
        self.cfg = cfg
        # the trained policy is softmax(logits / tau) at the sampling temperature, as in the job
        self.trainer = Trainer(copy.deepcopy(student), learner, temperature=cfg.rollout.sampling.policy_temperature)
        self.engine = EmbeddedEngine(copy.deepcopy(student).eval(), max_num_seqs=64)
        self.rng = random.Random(seed)
        self.rows: list[dict] = []

    def evaluate(self, tasks: int) -> None:
        """The held-out evaluation of the current policy, into the last row."""
        self.rows[-1].update(evaluate(self.engine, self.cfg, tasks))

    def train(self, step: int) -> None:
        """RL step `step`: a batch sampled by the current policy, trained, the weights pushed; a new row."""
        t0 = time.perf_counter()
        played = play(self.engine, self.cfg, train_specs(self.cfg, step, self.rng, step))
        # a failed episode (e.g. past envs.episode_time_budget_s on a busy CPU) is not trained, as in the job
        batch = [t for t in played if not t.error and t.completion_ids]
        m = self.trainer.train_step(batch)
        self.engine.update_weights(self.trainer.export_weights(step + 1))
        self.rows.append({"step": step + 1, "reward": m["reward_mean"],
                          "success": sum(success(t.reward) for t in batch) / len(batch),
                          "malformed": m["malformed_frac"], "advantage_abs_mean": m["advantage_abs_mean"],
                          **({"distill_kl": m["distill_kl"]} if "distill_kl" in m else {}),
                          "failed": len(played) - len(batch), "seconds": time.perf_counter() - t0})


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 3.8))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (name, rows), color in zip(results["arms"].items(), colors, strict=False):
        train = [r for r in rows if "reward" in r]
        a.plot([r["step"] for r in train], [r["reward"] for r in train], marker=".", color=color, label=name)
        c.plot([r["step"] for r in train], [r["malformed"] for r in train], marker=".", color=color, label=name)
        ev = [r for r in rows if "eval_success" in r]
        b.plot([r["step"] for r in ev], [r["eval_success"] for r in ev], marker="o", color=color,
               label=f"{name}: greedy")
        b.plot([r["step"] for r in ev if "eval_sampled_success" in r],
               [r["eval_sampled_success"] for r in ev if "eval_sampled_success" in r], marker="s", ls=":", color=color,
               label=f"{name}: sampled")
    a.set(xlabel="RL step", ylabel="training reward (the step's batch)", ylim=(0, 1.02))
    b.set(xlabel="RL step", ylabel="held-out success: greedy / sampled", ylim=(0, 1.02))
    c.set(xlabel="RL step", ylabel="malformed episodes (training batch)", ylim=(0, 1.02))
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"k3-tiny student on KeyLookup; teacher's held-out greedy success "
                 f"{results['teacher']['eval_success']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher-sft-steps", type=int, default=100)
    ap.add_argument("--teacher-sft-lr", type=float, default=3e-3)
    ap.add_argument("--teacher", help="the teacher's checkpoint directory: loaded when it holds one, else "
                                      "written there (default: a temporary directory)")
    ap.add_argument("--student", help="the student's checkpoint directory (e.g. a job's warm start, "
                                      "checkpoints/step-N/reference): no SFT of its own")
    ap.add_argument("--student-sft-steps", type=int, default=20)
    ap.add_argument("--student-sft-lr", type=float, default=1e-2)
    ap.add_argument("--student-wrong-key", type=float, default=0.0,
                    help="the student's demonstrations from a careless oracle (KeyLookup oracle_wrong_key): "
                         "it learns every skill and picks the requested key only about 1 - q of the time")
    ap.add_argument("--rl-steps", type=int, default=12)
    ap.add_argument("--rl-lr", type=float, default=3e-4, help="learner.lr of both arms (the demo's: 1e-4)")
    ap.add_argument("--coef", type=float, default=1.0, help="the teacher's coef")
    ap.add_argument("--env-coef", type=float, default=1.0,
                    help="learner.distill.env_coef of the teacher's arm: 0 = pure on-policy distillation")
    ap.add_argument("--estimator", choices=("sampled", "exact"), default="sampled",
                    help="the teacher's estimator: sampled (the per-token advantage log T - log mu) or exact (the "
                         "per-token reverse KL over the vocabulary, a loss term; no --clip, discount 0)")
    ap.add_argument("--clip", type=float, help="the teacher's clip R: log T - log mu clipped to [-R, R] (default none)")
    ap.add_argument("--discount", default="0",
                    help="the teacher's discount gamma: each token also carries gamma^k of the k-th sampled token's "
                         "log-ratio after it (1 = the whole sequence's reverse KL; default 0, each token its own); "
                         "several, comma-separated, give a teacher arm each")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-tasks", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="job config overrides on examples/demo_from_scratch.yaml")
    ap.add_argument("--baseline", help="a previous run's json with the same student, seed and RL settings: its "
                                       "'RL alone' rows are reused instead of running that arm again (the "
                                       "script is deterministic on one machine)")
    ap.add_argument("--teacher-set", action="append", default=[], metavar="KEY=VALUE",
                    help="job config overrides for the teacher's arms only (e.g. learner.lr=2e-3: each arm at "
                         "its own rate on the same episode budget)")
    ap.add_argument("--only", choices=("rl", "teacher"), help="run one arm only (e.g. the two arms in two "
                                                                 "processes side by side)")
    ap.add_argument("--device", default="cpu", help="where the models, engines and trainers run (cuda: a GPU)")
    ap.add_argument("--out", default="experiments/results/distill/distill")
    args = ap.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    cfg = JobConfig.load(DEMO, [f"learner.lr={args.rl_lr}", *args.set])
    t0 = time.perf_counter()
    needs_demos = not args.student or not os.path.exists(os.path.join(args.teacher or "", "config.json"))
    demos = collect_demonstrations(cfg, "distill", cfg.learner.sft_episodes) if needs_demos else []

    teacher_dir = args.teacher or tempfile.mkdtemp(prefix="k3rl-teacher-")
    teacher_info = {"checkpoint": teacher_dir}
    if os.path.exists(os.path.join(teacher_dir, "config.json")):
        print(f"teacher: {teacher_dir}", flush=True)
        teacher = build_model("k3-tiny", checkpoint=teacher_dir, device=args.device)
    else:
        print(f"teacher: {args.teacher_sft_steps} SFT steps at {args.teacher_sft_lr}", flush=True)
        teacher = build_model("k3-tiny", seed=args.seed + 1, device=args.device)
        teacher_info["sft_nll"] = sft(teacher, cfg, demos, args.teacher_sft_steps, args.teacher_sft_lr, args.seed + 1)
        save_hf(teacher, teacher_dir)
    teacher_info.update(evaluate_model(teacher, cfg, args.eval_tasks))
    print(f"teacher: held-out greedy success {teacher_info['eval_success']:.2f}", flush=True)

    if args.student:
        print(f"student: {args.student}", flush=True)
        student = build_model("k3-tiny", checkpoint=args.student, device=args.device)
        student_info = {"checkpoint": args.student}
    else:
        print(f"student: {args.student_sft_steps} SFT steps at {args.student_sft_lr}", flush=True)
        student = build_model("k3-tiny", seed=args.seed, device=args.device)
    if args.student_wrong_key and not args.student:
        careless = JobConfig.load(DEMO, [f"learner.lr={args.rl_lr}", *args.set,
                                         f"envs.train.0.kwargs.oracle_wrong_key={args.student_wrong_key}"])
        print(f"student: demonstrations by a careless oracle (wrong key {args.student_wrong_key})", flush=True)
        demos = collect_demonstrations(careless, "distill", cfg.learner.sft_episodes)
    if not args.student:
        student_info = {"sft_nll": sft(student, cfg, demos, args.student_sft_steps, args.student_sft_lr, args.seed)}
    student_info.update(evaluate_model(student, cfg, args.eval_tasks))
    print(f"student: held-out greedy success {student_info['eval_success']:.2f}", flush=True)

    # the two arms in lockstep, the results written after every step: a run cut short still compares them
    discounts = [float(g) for g in args.discount.split(",")]
    arms = {} if args.baseline or args.only == "teacher" else {
        "RL alone": Arm(student, cfg, args.rl_steps, None, args.coef, args.clip, args.seed)}
    baseline = json.loads(Path(args.baseline).read_text())["arms"]["RL alone"] if args.baseline else None
    teacher_cfg = JobConfig.load(DEMO, [f"learner.lr={args.rl_lr}", *args.set, *args.teacher_set])
    for g in discounts if args.only != "rl" else []:
        name = "RL + teacher" if len(discounts) == 1 and not args.baseline else f"RL + teacher, discount {g:g}"
        name += f", coef {args.coef:g}" if args.coef != 1 else ""
        name = name.replace("RL + teacher", "teacher alone") if args.env_coef == 0 else name
        name += ", exact KL" if args.estimator == "exact" else ""
        name += "".join(f", {o}" for o in args.teacher_set)
        arms[name] = Arm(student, teacher_cfg, args.rl_steps, teacher_dir, args.coef, args.clip, args.seed, g, args.env_coef,
                         args.estimator)
    start = {"step": 0, **{k: v for k, v in student_info.items() if k.startswith("eval")}}
    try:
        for arm in arms.values():
            arm.rows.append(dict(start))
        for step in range(args.rl_steps):
            for name, arm in arms.items():
                arm.train(step)
                if (step + 1) % args.eval_every == 0 or step + 1 == args.rl_steps:
                    arm.evaluate(args.eval_tasks)
                print(f"  {name}: {json.dumps({k: round(v, 3) for k, v in arm.rows[-1].items()})}", flush=True)
            results = {"args": vars(args), "learner": cfg.learner.model_dump(mode="json"),
                       "sampling": cfg.rollout.sampling.model_dump(mode="json"), "teacher": teacher_info, "student": student_info,
                       "arms": {**({"RL alone": baseline[:step + 2]} if baseline else {}),
                                **{name: arm.rows for name, arm in arms.items()}}, "rl_steps_done": step + 1,
                       "seconds": time.perf_counter() - t0}
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump(results, f, indent=1)
            plot(results, args.out + ".png")
    finally:
        for arm in arms.values():
            arm.engine.close()
    print(f"wrote {args.out}.json and {args.out}.png ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
