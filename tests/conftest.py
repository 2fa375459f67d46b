import pytest


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
