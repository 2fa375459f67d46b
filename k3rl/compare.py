"""`k3rl compare`: the reward curves of several runs side by side, read from MLflow — one PNG
with a curve per run and a table of final / best / mean reward and steps per run. When the runs
have a held-out evaluation (`envs.eval`: metrics `eval/<env>/success` and `eval/<env>/pass_at_<k>`),
the PNG gets a second panel with those curves (a colour per run, solid: greedy success, dotted:
pass@1, dashed: pass@k) and a second table with their last values.

Runs are named as `k3rl replay` names them (a run folder, a run name, an MLflow run id: k3rl.runs).
The picture: a mean metric (`reward/mean`) is drawn with its spread, the band of +- 1 std of the
step's episodes (`reward/std`); both panels share one x axis, RL steps (0: the starting policy,
before the first update; an eval at step s measures the policy after s updates); a metric whose
values lie in [0, 1] (rewards, success rates) is drawn on the whole [0, 1], any other from 0."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from k3rl.runs import RunNotFoundError, resolve_run
from k3rl.tracking import TrackingError, figure_png, find_run, metric_history, mlflow_client

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
    spread: dict[int, float] = field(default_factory=dict)  # step -> std of the step's episodes (reward/std)

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
        return {**{k: v for k, v in asdict(self).items() if k not in ("points", "evals", "spread")}, "steps": self.steps,
                "last_step": self.last_step, "final": self.final, "best": self.best, "best_step": self.best_step,
                "mean": self.mean, "eval": {k: pts[-1][1] for k, pts in self.evals.items()}}


def load_curves(runs: list[str], tracking_uri: str | None, metric: str, runs_dir: str | Path = "runs") -> list[RunCurve]:
    """The curves of `runs`: run references as `k3rl replay` takes them (a run folder, a run name, an
    MLflow run id; k3rl.runs). `tracking_uri` None: each run folder's own store, else runs/mlflow.db."""
    if not runs:
        raise CompareError("name at least one run to compare")
    curves: list[RunCurve] = []
    seen: set[str] = set()
    for name in runs:
        try:
            ref = resolve_run(name, runs_dir, tracking_uri)
        except RunNotFoundError as e:
            raise CompareError(str(e)) from None
        if ref.run_id is None:
            raise CompareError(f"run folder {ref.dir} names no MLflow run (no run.json): its curves are nowhere")
        client = mlflow_client(ref.tracking_uri)
        try:
            run = find_run(client, ref.run_id)
        except TrackingError as e:
            raise CompareError(f"run folder {ref.dir}: {e}") from None
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        points = metric_history(client, run.info.run_id, metric)
        if not points:
            available = ", ".join(sorted(run.data.metrics)) or "none"
            raise CompareError(f"run {run.info.run_name} ({run.info.run_id[:8]}) has no metric {metric!r}; "
                               f"its metrics: {available}")
        spread = metric_history(client, run.info.run_id, std_metric(metric)) if std_metric(metric) else []
        evals = {k: metric_history(client, run.info.run_id, k) for k in sorted(run.data.metrics) if EVAL_CURVE.fullmatch(k)}
        curves.append(RunCurve(run.info.run_name, run.info.run_id, run.info.status, points, evals, dict(spread)))
    return curves


def std_metric(metric: str) -> str | None:
    """The spread logged beside a mean (`reward/mean` -> `reward/std`), if the metric is one."""
    return metric.removesuffix("/mean") + "/std" if metric.endswith("/mean") else None


def compare_runs(runs: list[str], out: Path = Path("runs/compare.png"), tracking_uri: str | None = None,
                 metric: str = "reward/mean", console: Console | None = None, runs_dir: str | Path = "runs") -> list[dict]:
    """Plot `metric` of each run (a run reference) into one PNG at `out` and print a summary table.
    Returns one summary dict per run (name, run_id, status, steps, last_step, final, best,
    best_step, mean)."""
    console = console or Console()
    curves = load_curves(runs, tracking_uri, metric, runs_dir)
    names = [c.name for c in curves]
    labels = {c.run_id: c.name if names.count(c.name) == 1 else f"{c.name} ({c.run_id[:8]})" for c in curves}
    png = plot_runs(curves, labels, metric)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)

    table = Table(title=metric)
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


STEP_AXIS = "RL step (0: before the first update)"


def plot_runs(curves: list[RunCurve], labels: dict[str, str], metric: str) -> bytes:
    """PNG bytes: `metric` by run, and below it (when a run has them) the held-out eval curves."""
    fig, axes = figure(curves, labels, metric)
    return figure_png(fig, axes)


def figure(curves: list[RunCurve], labels: dict[str, str], metric: str):
    """The matplotlib figure of `plot_runs` and its axes (the metric's, then the eval's when there is one)."""
    matplotlib.use("Agg", force=False)
    with_eval = any(c.evals for c in curves)
    fig = Figure(figsize=(8, 8 if with_eval else 4.5), dpi=100)
    axes = fig.subplots(2 if with_eval else 1, 1, squeeze=False, sharex=True)[:, 0]
    # several envs: the eval panel colours by env and tells runs apart by marker
    envs = sorted({EVAL_CURVE.fullmatch(k).group("env") for c in curves for k in c.evals})
    for i, c in enumerate(curves):
        colour = f"C{i % 10}"
        _line(axes[0], c.points, labels[c.run_id], colour, "-")
        band = [(s, v, c.spread[s]) for s, v in c.points if s in c.spread and math.isfinite(v + c.spread[s])]
        if band:  # mean +- std of the step's episodes
            axes[0].fill_between([s for s, _, _ in band], [v - d for _, v, d in band], [v + d for _, v, d in band],
                                 color=colour, alpha=0.15, linewidth=0,
                                 label=f"{labels[c.run_id]}: ± 1 std of the step's episodes")
        for key, points in c.evals.items():
            env, kind = EVAL_CURVE.fullmatch(key).group("env", "kind")
            name = "success" if kind == "success" else kind.replace("pass_at_", "pass@")
            by_env = len(envs) > 1
            _line(axes[-1], points, f"{labels[c.run_id]}: {env} {name}", f"C{envs.index(env) % 10}" if by_env else colour,
                  "-" if kind == "success" else ":" if kind == "pass_at_1" else "--", MARKERS[i % len(MARKERS)] if by_env else "o")
    values = [v for c in curves for _, v in c.points if math.isfinite(v)]
    axes[0].set(title=f"{metric} by run", xlabel=STEP_AXIS, ylabel=metric, ylim=value_range(values))
    if with_eval:
        axes[0].set_xlabel("")  # the shared axis is labelled once, under the lower panel
        axes[1].set(title="held-out evaluation (greedy success, pass@k)", xlabel=STEP_AXIS, ylabel="rate",
                    ylim=(-0.03, 1.03))
    return fig, list(axes)


def value_range(values: list[float]) -> tuple[float, float]:
    """The y range of a metric: [0, 1] (padded) when its values lie there, else from 0 (or below it) to the top."""
    lo, hi = min(values, default=0.0), max(values, default=1.0)
    if 0.0 <= lo and hi <= 1.0:
        return -0.03, 1.03
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    pad = 0.05 * (hi - lo or 1.0)
    return lo - pad, hi + pad


MARKERS = "os^Dv<>p"


def _line(ax, points: list[tuple[int, float]], label: str, colour: str, style: str, marker: str = "o") -> None:
    xs = [s for s, v in points if math.isfinite(v)]
    ys = [v for s, v in points if math.isfinite(v)]
    ax.plot(xs, ys, style, color=colour, marker=marker if len(xs) < 30 else None, markersize=3, label=label)
