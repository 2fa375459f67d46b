"""k3rl.kernels: each op beside its pure-PyTorch reference, with a ``backend=`` dispatcher.

Ops (one sub-package each): ``kda`` (chunk and recurrent Kimi Delta Attention), ``situ``
(SiTU-GLU), ``moe`` (latent experts), ``attention`` (causal attention, fp32 output),
``qb_histogram`` (Quantile Balancing), ``newton_schulz`` (batched Muon orthogonalisation).
This package imports nothing else of the project.

Triton compiles a kernel once per specialisation of its integer arguments: a value of 1, a multiple
of 16, any other. An argument that counts tokens (``n_rows``, ``T``, ``N``, ``n``, ``m``, ``per_prog``)
changes with every packed batch and prompt, so its kernels are declared ``do_not_specialize`` on it:
one compile serves every length, and a train step or a prefill whose length first happens to be a
multiple of 16 does not stop for seconds to compile every such kernel again.
"""

_handed_over = False
if __name__ == "kernels":  # pragma: no cover - exercised in a subprocess by tests/kernels/test_package_name.py
    # Imported as top-level `kernels`: the repository root is on sys.path (`python -m ...` run from it) and
    # someone (transformers >= 5.25) asked for Hugging Face's `kernels` package. This folder is
    # `k3rl.kernels`; when the other package is installed, hand the name over to it.
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _os.path.abspath(p or ".") != _root])
    if _spec is not None:
        _module = _module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this file
        _spec.loader.exec_module(_module)
        _handed_over = True

if not _handed_over:
    from .attention import causal_attention
    from .kda import chunk_kda, fused_recurrent_kda, kda_chunk_transition, naive_recurrent_kda
    from .moe import latent_experts
    from .newton_schulz import newton_schulz
    from .qb_histogram import qb_histogram, qb_quantile
    from .situ import situ_glu

__all__ = [
    "causal_attention",
    "chunk_kda",
    "fused_recurrent_kda",
    "kda_chunk_transition",
    "latent_experts",
    "naive_recurrent_kda",
    "newton_schulz",
    "qb_histogram",
    "qb_quantile",
    "situ_glu",
]
