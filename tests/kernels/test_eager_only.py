"""kernels.eager_only: the Triton kernels' host wrappers are graph breaks for torch.compile (as
torch.compiler.disable makes them); that importing the model imports no torch._dynamo is
tests/test_imports.py's."""

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

