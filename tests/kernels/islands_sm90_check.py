"""Compile the KDA island kernels for Hopper (sm_90) on the CPU with their launch settings and print
each one's shared memory in bytes (JSON). Run as a script by test_kda_islands.py, so that
TRITON_INTERPRET=1 elsewhere does not matter; catches what the interpreter cannot (a construct the
compiler refuses)."""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import sm90_compile  # noqa: E402

from k3rl.kernels.kda import triton_output_gate as tg  # noqa: E402
from k3rl.kernels.kda import triton_short_conv as tc  # noqa: E402

TYPES = {  # argument -> Triton type; bf16 activations, fp32 weights and partial sums
    **dict.fromkeys(["x", "left", "y", "dy", "dx", "o", "g", "do", "dg", "tail"], "*bf16"),
    **dict.fromkeys(["w", "dw_part", "rstd", "da"], "*fp32"),
    **dict.fromkeys(["pos", "doc"], "*i32"),
    **dict.fromkeys(["T", "C", "NT", "n_rows", "per_prog", "B"], "i32"),
    "eps": "fp32",
}


def shared_bytes(kernel, constexprs, num_warps=4, num_stages=3):
    return sm90_compile.shared_bytes(kernel, constexprs, TYPES, num_warps, num_stages)


def main():
    conv = dict(W=4, BT=tc.BT, BC=tc.BC, HAS_POS=True, HAS_LEFT=False)
    decode = dict(conv, HAS_POS=False, HAS_LEFT=True)
    da = dict(conv, BT=tc.DA_BT, NB=tc.DA_NB)
    BD, BR = tg._blocks(128)
    gate = dict(D=128, BD=BD, BR=BR)
    print(json.dumps({
        "short_conv_fwd": shared_bytes(tc.short_conv_fwd_kernel, conv),
        "short_conv_da": shared_bytes(tc.short_conv_da_kernel, da, tc.DA_WARPS),
        "short_conv_dx": shared_bytes(tc.short_conv_dx_kernel, dict(W=4, BT=tc.BT, BC=tc.BC, HAS_POS=True)),
        "short_conv_fwd_left": shared_bytes(tc.short_conv_fwd_kernel, decode),
        "short_conv_da_left": shared_bytes(tc.short_conv_da_kernel, dict(da, HAS_POS=False, HAS_LEFT=True), tc.DA_WARPS),
        # a window a document (a branch forked from a shared prefix)
        "short_conv_fwd_doc_left": shared_bytes(tc.short_conv_fwd_kernel, dict(conv, HAS_LEFT=True)),
        "short_conv_da_doc_left": shared_bytes(tc.short_conv_da_kernel, dict(da, HAS_LEFT=True), tc.DA_WARPS),
        "short_conv_decode": shared_bytes(tc.short_conv_decode_kernel, dict(W=4, BB=tc.DECODE_BB, BC=tc.BC)),
        "norm_gate_fwd": shared_bytes(tg.norm_gate_fwd_kernel, gate),
        "norm_gate_bwd": shared_bytes(tg.norm_gate_bwd_kernel, gate),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
