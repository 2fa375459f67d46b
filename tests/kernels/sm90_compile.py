"""Compile one Triton kernel for Hopper (sm_90) on the CPU (Triton's bundled ptxas; no GPU needed) and
return its shared memory in bytes. Used by the *_sm90_check.py scripts, which set TRITON_INTERPRET=0
before importing this module."""

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def shared_bytes(kernel, constexprs: dict, types: dict, num_warps: int = 4, num_stages: int = 3) -> int:
    """`types`: argument name -> Triton type of every argument that is not in `constexprs`; pointers
    are 16-byte aligned, as at a real launch."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared
