import os
import sys

import pytest

# Ray takes the machine's address for its nodes and rewrites a 127.0.0.1 cluster address to it (it asks the
# route to a public address which one). Off, as on macOS: every node and client of the tests' Ray clusters on
# loopback (set before anything imports ray; the CLI's jobs inherit it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# what k3rl.cluster.init_ray sets for a job's local Ray, for the tests' other Rays too (ray.init of the actor tests,
# `ray start --head` clusters): no idle workers started ahead, no metrics or task events for a dashboard
from k3rl.cluster import LOCAL_RAY_ENV, NO_DASHBOARD_RAY_ENV  # noqa: E402

for _k, _v in {**LOCAL_RAY_ENV, **NO_DASHBOARD_RAY_ENV}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="module")
def module_ray():
    """One local Ray for the in-process jobs of a module: the module's first `run_job` starts it with its
    config (namespace, runtime_env: the module's jobs share them) and the later ones join it
    (`k3rl.cluster.init_ray` joins a Ray this process already runs), so Ray starts and stops once a module
    (about 6 s + 2 s on 2 cores) instead of once a job. A job ends its own actors; stopped with the module."""
    import ray

    ray.shutdown()  # none that another module left running: the first job starts one with its own config
    yield
    ray.shutdown()


# ---- jobs that run beside the suite (tests/background.py) ----------------------------------------------------
_BACKGROUND: dict = {}  # "runner": the runner process, "folder": its results


def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for work started at collection last (in their order): the interpreter cases' tests,
    then those of background jobs. That work then has the whole suite's time to run beside it before a
    test waits for it."""
    def rank(item) -> int:
        return 2 if item.get_closest_marker("background") else 1 if item.get_closest_marker("interpreter_cases") else 0

    items.sort(key=rank)  # stable: the order within each rank is kept


def pytest_collection_finish(session):
    """Start the selected background jobs (tests marked `background`) in one runner process, in test order;
    start the process of the interpreter case files the selected tests run (tests/kernels/interpreter_run.py)."""
    if session.config.option.collectonly:
        return
    interpreter_run = sys.modules.get("interpreter_run")
    if interpreter_run is not None:
        interpreter_run.WANTED.update(mark.args[0] for item in session.items
                                      for mark in item.iter_markers("interpreter_cases"))
        interpreter_run.start(sorted(interpreter_run.WANTED))
    jobs = [f"{item.path}:{mark.args[0]}" for item in session.items
            for mark in item.iter_markers("background")]
    if jobs:
        import tempfile
        from pathlib import Path

        import background

        _BACKGROUND["folder"] = Path(tempfile.mkdtemp(prefix="k3rl-background-"))
        _BACKGROUND["runner"] = background.start(_BACKGROUND["folder"], list(dict.fromkeys(jobs)))


def pytest_unconfigure(config):
    interpreter_run = sys.modules.get("interpreter_run")
    if interpreter_run is not None:
        interpreter_run.stop()
    if "runner" in _BACKGROUND:
        import shutil

        import background

        background.stop(_BACKGROUND["runner"], _BACKGROUND["folder"])
        shutil.rmtree(_BACKGROUND.pop("folder"), ignore_errors=True)
        _BACKGROUND.pop("runner")


@pytest.fixture
def background_job(request):
    """(summary, folder) of this test's background job, once it has finished (it started at collection)."""
    import background

    mark = request.node.get_closest_marker("background")
    assert mark and "runner" in _BACKGROUND, "a background_job test needs @pytest.mark.background(<job>)"
    name = mark.args[0]
    timeout = request.node.get_closest_marker("timeout")
    summary = background.wait_for(_BACKGROUND["folder"], name, _BACKGROUND["runner"],
                                  timeout_s=(timeout.args[0] if timeout else 600) - 30)
    return summary, _BACKGROUND["folder"] / name
