"""`k3rl compare`: the reward curves of several runs side by side, read from MLflow — one PNG
with a curve per run and a table of final / best / mean reward and steps per run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from k3rl.tracking import TrackingError, find_run, metric_history, mlflow_client, plot_curves, sqlite_path


class CompareError(ValueError):
    """Runs or a metric that cannot be compared; the message says what exists."""


@dataclass
class RunCurve:
    name: str
    run_id: str
    status: str
    points: list[tuple[int, float]]

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
        return {**{k: v for k, v in asdict(self).items() if k != "points"}, "steps": self.steps,
                "last_step": self.last_step, "final": self.final, "best": self.best, "best_step": self.best_step,
                "mean": self.mean}


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
        curves.append(RunCurve(run.info.run_name, run.info.run_id, run.info.status, points))
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
    png = plot_curves({labels[c.run_id]: c.points for c in curves}, title=f"{metric} by run", ylabel=metric)
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
    console.print(f"reward curves: {out}")
    return [c.summary() for c in curves]
