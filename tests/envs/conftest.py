"""Fixtures of the environment tests: the real sandbox backend ("auto": Docker when it answers, else bwrap).

K3RL_TEST_SANDBOX_BACKEND=bwrap (or docker) pins the backend.
"""

import functools
import os

import pytest

BACKEND = os.environ.get("K3RL_TEST_SANDBOX_BACKEND", "auto")


@functools.cache
def sandbox_capabilities() -> dict[str, bool]:
    """What the real sandbox of this host can run (probed once)."""
    from k3rl.sandboxes import open_sandbox

    with open_sandbox(backend=BACKEND) as sb:
        def ok(code: str) -> bool:
            return sb.exec(["python3", "-c", code], timeout=60).exit_code == 0

        return {"python": ok("print(1)"), "pytest": ok("import pytest"), "matplotlib": ok("import matplotlib")}


def _require(*needs: str) -> None:
    caps = sandbox_capabilities()
    missing = [n for n in ("python", *needs) if not caps.get(n)]
    if missing:
        pytest.skip(f"the {BACKEND} sandbox lacks {missing}: run `k3rl sandbox build` to build the sandbox image")


@pytest.fixture
def require_sandbox():
    """`require_sandbox("pytest", "matplotlib")` skips the test when the real sandbox cannot run those."""
    return _require
