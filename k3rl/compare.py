"""`k3rl compare`: the reward curves of several runs side by side, read from MLflow — one PNG
with a curve per run and a table of final / best / mean reward and steps per run. When the runs
have a held-out evaluation (`envs.eval`: metrics `eval/<env>/success` and `eval/<env>/pass_at_<k>`),
the PNG gets a second panel with those curves (a colour per run, solid: greedy success, dotted:
pass@1, dashed: pass@k) and a second table with their last values."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from k3rl.tracking import TrackingError, figure_png, find_run, metric_history, mlflow_client, sqlite_path

EVAL_CURVE = re.compile(r"eval/(?P<env>.+)/(?P<kind>success|pass_at_\d+)")


class CompareError(ValueError):
    """Runs or a metric that cannot be compared; the message says what exists."""


@dataclass
class RunCurve:
    name: str
    run_id: str
    status: str
    points: list[tuple[int, float]]
    evals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # eval/<env>/<kind> -> points

    @property
    def steps(self) -> int:
        return len(self.points)

    @property
    def last_step(self) -> int:
        return self.points[-1][0]

    @property
    def final(self) -> float:
        return self.points[-1][1]

    @property
    def best(self) -> float:
        return max(v for _, v in self.points)

    @property
    def best_step(self) -> int:
        best = self.best
        return next(s for s, v in self.points if v == best)

    @property
    def mean(self) -> float:
        return sum(v for _, v in self.points) / len(self.points)

    def summary(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("points", "evals")}, "steps": self.steps,
                "last_step": self.last_step, "final": self.final, "best": self.best, "best_step": self.best_step,
                "mean": self.mean, "eval": {k: pts[-1][1] for k, pts in self.evals.items()}}


def load_curves(runs: list[str], tracking_uri: str, metric: str) -> list[RunCurve]:
    if not runs:
        raise CompareError("name at least one run to compare")
    db = sqlite_path(tracking_uri)
    if db is not None and not db.exists():
        raise CompareError(f"no MLflow store at {db} (from {tracking_uri}); pass --tracking-uri of the runs' store")
    client = mlflow_client(tracking_uri)
    curves: list[RunCurve] = []
    seen: set[str] = set()
    for name in runs:
        try:
            run = find_run(client, name)
        except TrackingError as e:
            raise CompareError(str(e)) from None
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        points = metric_history(client, run.info.run_id, metric)
        if not points:
            available = ", ".join(sorted(run.data.metrics)) or "none"
            raise CompareError(f"run {run.info.run_name} ({run.info.run_id[:8]}) has no metric {metric!r}; "
                               f"its metrics: {available}")
        evals = {k: metric_history(client, run.info.run_id, k) for k in sorted(run.data.metrics) if EVAL_CURVE.fullmatch(k)}
        curves.append(RunCurve(run.info.run_name, run.info.run_id, run.info.status, points, evals))
    return curves


def compare_runs(runs: list[str], out: Path = Path("runs/compare.png"), tracking_uri: str = "sqlite:///runs/mlflow.db",
                 metric: str = "reward/mean", console: Console | None = None) -> list[dict]:
    """Plot `metric` of each run (by name or id) into one PNG at `out` and print a summary table.
    Returns one summary dict per run (name, run_id, status, steps, last_step, final, best,
    best_step, mean)."""
    console = console or Console()
    curves = load_curves(runs, tracking_uri, metric)
    names = [c.name for c in curves]
    labels = {c.run_id: c.name if names.count(c.name) == 1 else f"{c.name} ({c.run_id[:8]})" for c in curves}
    png = plot_runs(curves, labels, metric)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)

    table = Table(title=f"{metric} ({tracking_uri})")
    for col, justify in (("run", "left"), ("id", "left"), ("status", "left"), ("steps", "right"),
                         ("final", "right"), ("best (step)", "right"), ("mean", "right")):
        table.add_column(col, justify=justify)
    for c in curves:
        table.add_row(labels[c.run_id], c.run_id[:8], c.status, f"{c.steps} (to {c.last_step})", f"{c.final:.4f}",
                      f"{c.best:.4f} ({c.best_step})", f"{c.mean:.4f}")
    console.print(table)
    keys = sorted({k for c in curves for k in c.evals})
    if keys:
        evals = Table(title="held-out evaluation: last value (step)")
        evals.add_column("run")
        for k in keys:
            evals.add_column(k.removeprefix("eval/"), justify="right")
        for c in curves:
            evals.add_row(labels[c.run_id], *(f"{c.evals[k][-1][1]:.3f} ({c.evals[k][-1][0]})" if c.evals.get(k) else "-"
                                              for k in keys))
        console.print(evals)
    console.print(f"reward curves: {out}")
    return [c.summary() for c in curves]


def plot_runs(curves: list[RunCurve], labels: dict[str, str], metric: str) -> bytes:
    """PNG bytes: `metric` by run, and below it (when a run has them) the held-out eval curves."""
    matplotlib.use("Agg", force=False)
    with_eval = any(c.evals for c in curves)
    fig = Figure(figsize=(8, 8 if with_eval else 4.5), dpi=100)
    axes = fig.subplots(2 if with_eval else 1, 1, squeeze=False)[:, 0]
    for i, c in enumerate(curves):
        colour = f"C{i % 10}"
        _line(axes[0], c.points, labels[c.run_id], colour, "-")
        for key, points in c.evals.items():
            env, kind = EVAL_CURVE.fullmatch(key).group("env", "kind")
            name = "success" if kind == "success" else kind.replace("pass_at_", "pass@")
            _line(axes[-1], points, f"{labels[c.run_id]}: {env} {name}", colour, "-" if kind == "success" else ":" if kind == "pass_at_1" else "--")
    axes[0].set(title=f"{metric} by run", xlabel="step", ylabel=metric)
    if with_eval:
        axes[1].set(title="held-out evaluation (greedy success, pass@k)", xlabel="RL steps done", ylabel="rate",
                    ylim=(-0.03, 1.03))
    return figure_png(fig, axes)


def _line(ax, points: list[tuple[int, float]], label: str, colour: str, style: str) -> None:
    xs = [s for s, v in points if math.isfinite(v)]
    ys = [v for s, v in points if math.isfinite(v)]
    ax.plot(xs, ys, style, color=colour, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
