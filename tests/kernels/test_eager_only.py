"""kernels.eager_only: the Triton kernels' host wrappers are graph breaks for torch.compile (as
torch.compiler.disable makes them), and importing the model no longer imports torch._dynamo."""

import subprocess
import sys

import torch

from k3rl.kernels._backend import before_compile, eager_only


@eager_only
def _host_side(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum().item())  # .item(): a host sync, as a kernel's launch settings need


def test_an_eager_only_function_is_a_graph_break_under_compile_and_computes_the_same():
    def caller(x):
        return _host_side(torch.sin(x)) + 1

    x = torch.randn(5)
    before_compile()
    explained = torch._dynamo.explain(caller)(x)
    assert explained.graph_break_count >= 1
    assert any("disable" in str(b.reason).lower() for b in explained.break_reasons), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(caller, backend="eager", fullgraph=False)
    torch.testing.assert_close(compiled(x), caller(x))


def test_importing_the_model_and_the_actors_does_not_import_dynamo():
    code = ("import sys, k3rl.model, k3rl.learner.actor, k3rl.rollout.worker, k3rl.rollout.engine; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"torch._dynamo is imported again at import time (about 1 s a process): {out}"
