import os

import pytest
import ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for the module (or the one a previous module left running)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    if started:
        ray.shutdown()
