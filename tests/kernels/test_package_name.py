"""The repository's `kernels/` folder is `k3rl.kernels`; from the repository root (on sys.path under
`python -m`), a bare `import kernels` reaches Hugging Face's `kernels` package when it is installed
(transformers >= 5.25 imports it), and k3rl's kernels stay k3rl's."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, kernels, k3rl.kernels
print(json.dumps({"bare": kernels.__file__, "ours": k3rl.kernels.__file__,
                  "ours_has_kda": callable(getattr(k3rl.kernels, "chunk_kda", None))}))
"""


def _installed_kernels() -> bool:
    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_bare_kernels_from_the_repository_root_is_the_installed_package():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(seen["ours"]).resolve() == ROOT / "kernels" / "__init__.py" and seen["ours_has_kda"]
    if _installed_kernels():  # Hugging Face's package: the bare name is its, found past the repository root
        assert not Path(seen["bare"]).resolve().is_relative_to(ROOT / "kernels"), seen
    else:  # nothing else of that name: the folder itself answers
        assert Path(seen["bare"]).resolve() == ROOT / "kernels" / "__init__.py"
