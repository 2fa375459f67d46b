"""The `k3rl` command line (typer). Each command imports its module only when it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.syntax import Syntax

from k3rl import examples
from k3rl.config import ConfigError, JobConfig


def _conventional_help() -> None:
    """typer's help shows a flag's type (`--resume <bool>`) as if it took a value, and a required argument
    as `{run}`: show flags without a type and arguments as the usual RUN, [CONFIG], RUN..."""
    show_type = getattr(typer.core.TyperOption, "display_type_rich", None)  # older typers show no types: nothing to do
    if show_type is not None:
        typer.core.TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else show_type(self, ctx)

    def usage_name(self) -> str:
        name = self.metavar or self.name.upper()
        return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")

    if hasattr(typer.core.TyperArgument, "_usage_display_name"):
        typer.core.TyperArgument._usage_display_name = usage_name


_conventional_help()

app = typer.Typer(
    name="k3rl",
    help="Agentic RL post-training for Kimi K3-architecture models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
config_app = typer.Typer(help="Inspect job configs.", no_args_is_help=True)
envs_app = typer.Typer(help="List and check the registered tool environments.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(envs_app, name="envs")

console = Console()
err = Console(stderr=True)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE",
                                                     help="override a config value: a.b.c=value (repeatable)")]
RunsDirOpt = Annotated[Path, typer.Option(help="the runs folder (tracking.runs_dir)")]
TrackingOpt = Annotated[Optional[str], typer.Option(
    help="MLflow tracking URI (default: a run folder's own store, else sqlite:///runs/mlflow.db)")]
RUN_REF = "a run folder (runs/<name>), a run name, or an MLflow run id"


def _config_path(config: Optional[Path]) -> Optional[Path]:
    """`config`; or, when that is not a file and names an example installed with k3rl (`k3rl train demo.yaml`
    from any directory, `.yaml` optional), the example."""
    if config is None or config.exists() or len(config.parts) != 1:
        return config
    for name in (config.name, config.name + ".yaml"):
        if (examples.HERE / name).is_file():
            err.print(f"[yellow]note:[/] no file {config} here: the example installed with k3rl, "
                      f"{examples.HERE / name}", highlight=False, soft_wrap=True)
            return examples.HERE / name
    jobs = ", ".join(sorted(p.name for p in examples.HERE.glob("*.yaml")))
    _refused(ConfigError(f"config file {config} does not exist, nor is it an example installed with k3rl ({jobs})"))


def _load(config: Optional[Path], overrides: Optional[list[str]]) -> JobConfig:
    try:
        cfg = JobConfig.load(_config_path(config), overrides or [])
    except ConfigError as e:
        _refused(e)
    for note in cfg.notes():
        err.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    return cfg


def _refused(e: ConfigError) -> NoReturn:
    err.print("[bold red]error:[/] ", end="")
    err.print(str(e), markup=False, highlight=False, soft_wrap=True)  # the message may hold [brackets]
    raise typer.Exit(2) from None


@config_app.command("show")
def config_show(
    config: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="job YAML (omit for the defaults)")] = None,
    set_: SetOpt = None,
    save: Annotated[Optional[Path], typer.Option(metavar="FILE", help="also write the resolved config here")] = None,
) -> None:
    """Print the resolved config (defaults + file + --set overrides)."""
    cfg = _load(config, set_)
    console.print(Syntax(cfg.to_yaml(), "yaml", theme="ansi_dark", background_color="default"))
    if save:
        cfg.save(save)
        console.print(f"saved to {save}")


@app.command()
def train(
    config: Annotated[Optional[Path], typer.Argument(metavar="CONFIG",
                                                     help="job YAML (omit for the embedded defaults)")] = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue the run (tracking.run_name) from its last "
                                                          "checkpoint; a flag, no value")] = False,
) -> None:
    """Run an agentic RL job (local Ray by default, or the cluster at ray.address)."""
    cfg = _load(config, set_)
    # lazy: torch, Ray and MLflow take seconds to import; only `train` needs them
    from k3rl.job import run_job

    try:  # the job checks env ids, envs.imports and its first prompts before Ray starts
        result = run_job(cfg, resume=resume)
    except ConfigError as e:  # refused by the job's own checks before it started
        _refused(e)
    # stopped by a signal, after a checkpoint: 128 + it (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP; k3rl/job.py Stop)
    raise typer.Exit(0 if result["completed"] else 128 + (result["signal"] or 2))


@app.command()
def runs(
    runs_dir: Annotated[Path, typer.Argument(metavar="RUNS_DIR", help="the runs folder (tracking.runs_dir)")] = Path("runs"),
    tracking_uri: TrackingOpt = None,
) -> None:
    """The runs of a runs folder and its MLflow store: status, steps, time, final and best reward, last eval."""
    # lazy: k3rl.runs reads MLflow (seconds to import); only `runs` needs it
    from k3rl.runs import list_runs, print_runs

    print_runs(list_runs(runs_dir, tracking_uri), console, tracking_uri or str(runs_dir), runs_dir)


@app.command()
def sync(
    run: Annotated[str, typer.Argument(metavar="RUN", help=RUN_REF)],
    runs_dir: RunsDirOpt = Path("runs"),
    tracking_uri: TrackingOpt = None,
) -> None:
    """Send what a job could not write to MLflow (its store was down; kept in <run dir>/tracking_spool.jsonl)."""
    # lazy: these read MLflow (seconds to import); only `sync` needs them
    from k3rl.runs import resolve_run
    from k3rl.tracking import mlflow_client
    from k3rl.tracking_writer import Spool, replay

    ref = resolve_run(run, runs_dir, tracking_uri)
    if ref.dir is None or ref.run_id is None:
        err.print(f"[bold red]error:[/] {run!r} needs both a run folder and its MLflow run id (run.json) to sync")
        raise typer.Exit(2)
    spool = Spool(ref.dir)
    sent, left = replay(mlflow_client(ref.tracking_uri), ref.run_id, spool)
    console.print(f"{ref.name}: sent {sent} spooled records to {ref.tracking_uri}" +
                  (f"; [yellow]{left} still wait in {spool.path} (is the store up?)[/]" if left else ""))
    raise typer.Exit(1 if left else 0)


@app.command()
def replay(
    run: Annotated[Optional[str], typer.Argument(metavar="RUN", help=f"{RUN_REF}; omit for the newest run")] = None,
    episode: Annotated[Optional[str], typer.Option(metavar="ID", help="an episode by id (a prefix is enough)")] = None,
    step: Annotated[Optional[int], typer.Option(metavar="N", help="a training step (default: the last)")] = None,
    worst: Annotated[bool, typer.Option("--worst", help="the worst episode instead of the best")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="the episodes that failed (an error: never trained)")] = False,
    eval_: Annotated[bool, typer.Option("--eval", help="the held-out evaluation's episodes")] = False,
    html: Annotated[Optional[Path], typer.Option(metavar="PAGE", help="write the episode as an HTML page, and the "
                                                 "step's others beside it")] = None,
    re_execute: Annotated[bool, typer.Option("--re-execute", help="replay the tool calls in a fresh sandbox")] = False,
    runs_dir: RunsDirOpt = Path("runs"),
    tracking_uri: TrackingOpt = None,
) -> None:
    """Show an episode turn by turn among its step: by default the best trained episode of the last step,
    with its GRPO group (rewards, advantages) and its reward's parts."""
    # lazy: replay reads MLflow and torch (seconds to import); only `replay` needs them
    from k3rl.replay import replay_command

    if failed and eval_:
        err.print("[bold red]error:[/] --failed and --eval pick different episodes: give one")
        raise typer.Exit(2)
    raise typer.Exit(replay_command(run, episode=episode, step=step, html=html, re_execute=re_execute, worst=worst,
                                    failed=failed, eval_=eval_, runs_dir=runs_dir, tracking_uri=tracking_uri))


@app.command()
def compare(
    runs: Annotated[list[str], typer.Argument(metavar="RUN", help=RUN_REF)],
    out: Annotated[Path, typer.Option(metavar="PNG", help="PNG of the reward curves")] = Path("runs/compare.png"),
    metric: Annotated[str, typer.Option(metavar="NAME", help="metric to plot")] = "reward/mean",
    runs_dir: RunsDirOpt = Path("runs"),
    tracking_uri: TrackingOpt = None,
) -> None:
    """Reward curves of several runs side by side (with their spread and held-out eval), read from MLflow."""
    # lazy: MLflow takes seconds to import; only `compare` needs it
    from k3rl.compare import CompareError, compare_runs

    try:
        compare_runs(runs, out=out, tracking_uri=tracking_uri, metric=metric, console=console, runs_dir=runs_dir)
    except CompareError as e:
        err.print("[bold red]error:[/] ", end="")
        err.print(str(e), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def ui(
    tracking_uri: Annotated[str, typer.Option(help="MLflow tracking URI")] = "sqlite:///runs/mlflow.db",
    port: Annotated[int, typer.Option()] = 5000,
) -> None:
    """Start the MLflow UI on the run store (loopback only): runs, reward curves, sample episodes as traces
    and HTML pages. Ctrl-C or SIGTERM stops it and its workers."""
    # one server worker: a local UI has one user, and MLflow's default of 4 slows start-up on small machines
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    console.print(f"MLflow UI on http://127.0.0.1:{port}  ({' '.join(cmd)})")
    console.print("sample episodes: the experiment's Traces tab (a span per turn and tool call), "
                  "and episodes/*.html among a run's artifacts")
    # without MLflow's job runner (a second process and a consumer of 10 workers, for its GenAI jobs, which
    # a view of k3rl's runs does not use): they slowed the UI's start and stop. The user's own setting wins.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
    raise typer.Exit(run_until_stopped(cmd, env=env))


@app.command()
def serve(
    checkpoint: Annotated[Path, typer.Argument(help="an HF-layout checkpoint directory (a run's, the release, "
                                                    "examples/keylookup_warm_start)")],
    preset: Annotated[str, typer.Option(help="the K3 preset the checkpoint was trained as")] = "k3-tiny",
    tokenizer: Annotated[str, typer.Option(help="'byte', or a directory with the checkpoint's tokenizer")] = "byte",
    thinking: Annotated[bool, typer.Option(help="the chat template's thinking mode")] = False,
    device: Annotated[str, typer.Option()] = "cpu",
    dtype: Annotated[Optional[str], typer.Option(help="default: float32 on CPU, bfloat16 on CUDA")] = None,
    max_context: Annotated[int, typer.Option(help="prompt + completion tokens a request may hold")] = 8192,
    host: Annotated[str, typer.Option(help="where to listen (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
) -> None:
    """Serve a checkpoint with the OpenAI-compatible chat-completions endpoint the rollouts use
    (POST http://HOST:PORT/v1/chat/completions): evaluate a trained policy with any agent harness."""
    if not checkpoint.is_dir():
        err.print(f"[bold red]error:[/] {checkpoint} is not a checkpoint directory (config.json + safetensors)")
        raise typer.Exit(2)
    # lazy: torch and the web stack take seconds to import; only `serve` needs them
    import uvicorn

    # lazy, as above: the engine's modules import torch
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.episode import make_template
    from k3rl.rollout.openai_endpoint import ChatEndpoint, make_app

    try:
        cfg = JobConfig.load(None, [f"model.preset={preset}", f"model.tokenizer={tokenizer}",
                                    f"model.thinking={str(thinking).lower()}"])
    except ConfigError as e:
        _refused(e)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    engine = EmbeddedEngine.from_preset(preset, checkpoint=str(checkpoint), device=device, dtype=dtype,
                                        max_model_len=max_context)
    endpoint = ChatEndpoint(engine.agenerate, make_template(cfg), model=checkpoint.name, max_context_tokens=max_context)
    console.print(f"serving {checkpoint} ({preset}, {device}, {dtype}) on http://{host}:{port}/v1  (Ctrl-C stops)")
    try:
        uvicorn.run(make_app(endpoint), host=host, port=port, log_level="warning")
    finally:
        engine.close()


class _Stopped(Exception):
    pass


def run_until_stopped(cmd: list[str], grace_s: float = 10.0, env: dict[str, str] | None = None) -> int:
    """Run `cmd` in a process group of its own until it exits, or until this process gets SIGINT,
    SIGTERM or SIGHUP: then the whole group (the server and every worker it forked) gets SIGTERM,
    and SIGKILL after `grace_s`. Returns the exit code (128 + signal when stopped)."""
    def stop(signum, _frame):
        raise _Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = None
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        return proc.wait()
    except _Stopped as e:
        return 128 + e.args[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc is not None:
            _stop_group(proc, grace_s)


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is empty: everything has exited
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


ImportOpt = Annotated[Optional[list[str]], typer.Option(
    "--import", help="a module that registers environments when imported, as in envs.imports (repeatable)")]


def _import_env_modules(modules: Optional[list[str]]) -> None:
    # lazy: importing k3rl.envs loads every env plugin; only `envs` needs them
    from k3rl.envs.registration import import_env_modules

    try:
        import_env_modules(modules or [], field="--import")
    except ConfigError as e:
        _refused(e)


@envs_app.command("list")
def envs_list(import_: ImportOpt = None) -> None:
    """Registered environments under the k3rl namespace (and third-party entry points)."""
    _import_env_modules(import_)
    # lazy: loads every env plugin (above)
    from k3rl.envs_cli import list_envs

    list_envs(console)


@envs_app.command("check")
def envs_check(env_id: Annotated[str, typer.Argument(metavar="ENV_ID", help="e.g. k3rl/KeyLookup-v0")], seed: int = 0,
               import_: ImportOpt = None) -> None:
    """Run Gymnasium's env checker and one oracle episode, printing the transcript."""
    _import_env_modules(import_)
    # lazy: loads every env plugin (above)
    from k3rl.envs.registration import unknown_env_message
    from k3rl.envs_cli import check_env_command

    unknown = unknown_env_message(env_id)
    if unknown:
        err.print("[bold red]error:[/] ", end="")
        err.print(f"{unknown} (a module of your own: --import MODULE; `k3rl envs list` shows what is registered)",
                  markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    raise typer.Exit(check_env_command(env_id, seed=seed, console=console))


@app.command()
def plan(
    preset: Annotated[str, typer.Option(help="model preset: k3, k3-small, k3-tiny")] = "k3",
    gpu: Annotated[str, typer.Option(help="GPU kind: h100, h200, b200")] = "h200",
    gpus: Annotated[int, typer.Option(help="GPUs in all (learner and rollout fleet)")] = 256,
    context: Annotated[int, typer.Option(help="tokens a sequence (prompt, tool results, generation)")] = 131072,
    group_size: Annotated[int, typer.Option(help="samples a prompt (GRPO group)")] = 8,
    prompts_per_step: Annotated[int, typer.Option(help="prompts a training step")] = 32,
    expert_precision: Annotated[str, typer.Option(help="the engines' routed experts: bf16 or mxfp4")] = "mxfp4",
) -> None:
    """A K3 RL job on N GPUs on paper: layout, memory per rank, step time, weight sync, decode rate, fit."""
    # lazy: the planner reads the model's config module; only `plan` needs it
    from k3rl.plan import PlanError, plan_job, print_plan

    try:
        result = plan_job(preset=preset, gpu=gpu, gpus=gpus, context=context, group_size=group_size,
                          prompts_per_step=prompts_per_step, expert_precision=expert_precision)
    except (PlanError, ValueError) as e:
        _refused(ConfigError(str(e)))
    print_plan(result, console)
    raise typer.Exit(0 if result.fits else 1)


def _mount_sandbox() -> None:
    try:  # the sandbox CLI needs the docker SDK; without it the other commands still work
        from k3rl.sandboxes.cli import app as sandbox_app
    except ImportError as e:
        sandbox_app = typer.Typer(help=f"Sandbox tools (unavailable: {e}).")
    app.add_typer(sandbox_app, name="sandbox", help="Build, check and clean up the sandboxes.")


_mount_sandbox()


if __name__ == "__main__":  # pragma: no cover
    app()
