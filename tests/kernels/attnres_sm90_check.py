"""Compile the Block AttnRes kernels for Hopper (sm_90) on the CPU at K3 width (d = 7168, bf16 sources,
the model's launch settings) for 2, 4 and 9 sources, and 4 of mixed dtypes (fp32 first, as under
autocast), and print each one's shared memory in bytes (JSON).
Run as a script by test_attnres_kernel.py, so that TRITON_INTERPRET=1 elsewhere does not matter; catches
what the interpreter cannot (a construct the compiler refuses, the tuple of source pointers).
``--ptx DIR`` also writes each kernel's PTX there (for ``ptxas -v``: registers and spills)."""

import inspect
import json
import os
import pathlib
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3rl.kernels.attnres import triton_aggregate as ta  # noqa: E402

D = 7168


def compile_kernel(kernel, S, first="bf16"):
    """first="fp32": the sources under autocast (an fp32 embedding block, then bf16 layer outputs)."""
    BD, BR, warps = ta.launch_settings(D)
    names = list(inspect.signature(kernel.fn).parameters)
    consts = dict(S=S, D=D, BD=BD, BR=BR, **({"H_SAVED": first == "fp32"} if "H_SAVED" in names else {}))
    types = {
        **dict.fromkeys(["srcs", "dsrcs"], (f"*{first}",) + ("*bf16",) * (S - 1)),
        **dict.fromkeys(["h", "dh"], f"*{first}"),
        **dict.fromkeys(["q", "logit", "rstd", "dq_part"], "*fp32"),
        **dict.fromkeys(["n_rows", "per_prog"], "i32"),
        "eps": "fp32",
    }
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    attrs = {}  # every pointer 16-byte aligned, as the launcher specialises torch's allocations
    for i, n in enumerate(names):
        if isinstance(sig[n], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(S)})
        elif sig[n].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
    )


def main():
    ptx_dir = pathlib.Path(sys.argv[sys.argv.index("--ptx") + 1]) if "--ptx" in sys.argv else None
    shared = {}
    for S, first in ((2, "bf16"), (4, "bf16"), (9, "bf16"), (4, "fp32")):
        for name, kernel in (("fwd", ta.aggregate_fwd_kernel), ("bwd", ta.aggregate_bwd_kernel)):
            compiled = compile_kernel(kernel, S, first)
            tag = f"{name}_S{S}" + ("_mixed" if first == "fp32" else "")
            shared[tag] = compiled.metadata.shared
            if ptx_dir:
                (ptx_dir / f"{tag}.ptx").write_text(compiled.asm["ptx"])
    print(json.dumps(shared))


if __name__ == "__main__":
    main()
