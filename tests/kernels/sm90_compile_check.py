"""Compile every Triton kernel for Hopper (sm_90) on the CPU and print its shared memory use.

Run as a script (a GPU is not needed: Triton's bundled ptxas builds the cubin). Used by
test_triton_compile.py in a subprocess, so that TRITON_INTERPRET=1 elsewhere does not matter.
Launch settings mirror the host code (CONFIG dicts, pointers 16-byte aligned as at a real launch).
``--regs`` prints each kernel's registers per thread and stack (spill) bytes instead, read from
the cubin with the bundled cuobjdump (what ``ptxas -v`` reports).
"""

import inspect
import json
import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3rl.kernels.kda import triton_chunk as tc  # noqa: E402
from k3rl.kernels.kda import triton_l2norm as tn  # noqa: E402
from k3rl.kernels.kda import triton_recurrent as tr  # noqa: E402
from k3rl.kernels.qb_histogram import triton_qb as tq  # noqa: E402
from k3rl.kernels.situ import triton_situ as ts  # noqa: E402

FP32_ARGS = {
    "rq",
    "rk",
    "G",
    "Ti",
    "dq",
    "dk",
    "dG",
    "dbeta",
    "dA",
    "dAqk_s",
    "h0",
    "ht",
    "dht",
    "dh0",
    "r",
    "dz",
    "dt_bias",
    "A_log",
    "dA_log",
    "ddt",
}
INT_ARGS = {"H", "T", "m", "n", "n_rows"}
FLOAT_ARGS = {"lo", "inv_width", "scale"}


def compile_one(kernel, constexprs, num_warps, num_stages=3):
    """The compiled kernel's shared memory in bytes (with --regs: its resource line)."""
    k = compile_kernel(kernel, constexprs, num_warps, num_stages)
    return resource_usage(k) if "--regs" in sys.argv else k.metadata.shared


def resource_usage(k):
    """'REG:n STACK:n ...' of a compiled kernel, from its cubin (cuobjdump -res-usage)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x).strip()
    return " ".join(line.split()[:3]) + f" (shared {k.metadata.shared} B)"


def compile_kernel(kernel, constexprs, num_warps, num_stages=3):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in INT_ARGS:
            sig[n] = "i32"
        elif n in FLOAT_ARGS:
            sig[n] = "fp32"
        elif n in {"cu", "chunk_idx", "chunk_off", "hist"}:
            sig[n] = "*i32"
        elif n == "mask":
            sig[n] = "*i8"
        else:
            sig[n] = "*fp32" if n in FP32_ARGS else "*bf16"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = ASTSource(
        kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def main():
    C = dict(K=128, V=128, BK=128, BV=tc.CONFIG["BV"])
    cfg = tc.CONFIG
    out = {
        "gate_cumsum_fwd": compile_one(
            tc.gate_cumsum_fwd_kernel, dict(K=128, BK=128, USE_GATE=True, HAS_BIAS=True, LB=-5.0), 4
        ),
        "gate_cumsum_bwd": compile_one(
            tc.gate_cumsum_bwd_kernel,
            dict(K=128, BK=128, USE_GATE=True, HAS_BIAS=True, LB=-5.0, PARAM_GRADS=True),
            4,
        ),
        "intra_fwd": compile_one(tc.intra_fwd_kernel, dict(C, BV=cfg["BV_intra"]), cfg["warps_intra"]),
        **{
            name: compile_one(
                tc.intra_blocks_fwd_kernel,
                dict(K=128, BK=128, L2NORM=norm, STORE_QK=norm, EPS=1e-6),
                cfg["warps_blocks"],
            )
            for name, norm in (("intra_blocks_fwd", False), ("intra_blocks_fwd_l2norm", True))
        },
        "intra_solve_fwd": compile_one(tc.intra_solve_fwd_kernel, dict(C, BV=cfg["BV_intra"]), cfg["warps_solve"]),
        "state_fwd": compile_one(
            tc.state_fwd_kernel,
            dict(C, HAS_H0=True, STORE_HT=True, STORE_H=True, FOR_LOOP=True, SPLIT_O=False, STORE_VN=True),
            cfg["warps_state"],
            cfg["stages_state"],
        ),
        "state_fwd_split": compile_one(
            tc.state_fwd_kernel,
            dict(C, HAS_H0=True, STORE_HT=True, STORE_H=True, FOR_LOOP=True, SPLIT_O=True, STORE_VN=True),
            cfg["warps_state"],
            cfg["stages_state"],
        ),
        "output_fwd": compile_one(
            tc.output_fwd_kernel, dict(K=128, V=128, BK=128, BV=cfg["BV_out"]), cfg["warps_out"]
        ),
        "state_bwd": compile_one(
            tc.state_bwd_kernel,
            dict(C, BV=cfg["BV_bwd"], HAS_DHT=True, STORE_DH0=True, FOR_LOOP=True),
            cfg["warps_state_bwd"],
            cfg["stages_state_bwd"],
        ),
        "grads_chunk": compile_one(
            tc.grads_chunk_kernel,
            dict(K=128, V=128, BV=cfg["BV_grads"], BKS=cfg["BKS"]),
            cfg["warps_grads"],
            cfg["stages_grads"],
        ),
        "grads_subtiles": compile_one(
            tc.grads_subtiles_kernel, dict(K=128, BKS=cfg["BKS_tiles"]), cfg["warps_subtiles"]
        ),
        **{
            name: compile_one(
                tr.recurrent_fwd_kernel,
                dict(
                    K=128,
                    V=128,
                    BK=128,
                    BV=tr.CONFIG["BV"],
                    L2NORM=True,
                    USE_GATE=True,
                    HAS_BIAS=True,
                    BOUNDED=True,
                    LB=-5.0,
                    HAS_H0=True,
                    STORE_HT=True,
                    EPS=1e-6,
                    VARLEN=varlen,
                    STREAM=stream,
                ),
                tr.CONFIG["num_warps"],
            )
            for name, varlen, stream in (("recurrent", True, False), ("recurrent_stream", False, True))
        },  # fmt: skip
        "situ_fwd": compile_one(ts.situ_fwd_kernel, dict(B1=4.0, B2=25.0, BLOCK=ts.BLOCK), 8),
        "situ_bwd": compile_one(ts.situ_bwd_kernel, dict(B1=4.0, B2=25.0, BLOCK=ts.BLOCK), 8),
        "l2norm_fwd": compile_one(tn.l2norm_fwd_kernel, dict(K=128, BK=128, BR=32, EPS=1e-6), 4),
        "l2norm_bwd": compile_one(tn.l2norm_bwd_kernel, dict(K=128, BK=128, BR=32), 4),
        "qb_hist": compile_one(tq.qb_hist_kernel, dict(BINS=1000, HAS_MASK=True, BM=64, BN=32), 4),
    }
    if "--regs" in sys.argv:
        for name, usage in out.items():
            print(f"{name:18s} {usage}")
    else:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
