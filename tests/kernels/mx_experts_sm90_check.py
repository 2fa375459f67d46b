"""Compile the MXFP4-expert kernels (kernels/moe/triton_mx_experts.py) for Hopper (sm_90) on the CPU at K3's
sizes (l = 3584, f = 3072, k = 16) in bf16 with their launch settings; print each one's shared memory in bytes
(JSON). Run as a script by test_mx_experts_kernel.py, so that TRITON_INTERPRET=1 elsewhere does not matter;
catches what the interpreter cannot (a construct the compiler refuses)."""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import sm90_compile  # noqa: E402
import triton.language as tl  # noqa: E402

from k3rl.kernels.moe import triton_mx_experts as tmx  # noqa: E402

TYPES = {  # argument -> Triton type: bf16 activations, uint8 bytes (MXFP4 weights, MXFP8 activations)
    **dict.fromkeys(["x", "z", "a", "y", "u"], "*bf16"),
    **dict.fromkeys(["el", "sc", "x_el", "x_sc", "a_el", "a_sc", "w1p", "w1s", "w3p", "w3s", "w2p", "w2s"], "*u8"),
    **dict.fromkeys(["p"], "*fp32"),
    **dict.fromkeys(["idx", "order", "row_token", "tile_expert", "pos"], "*i64"),
}
K, L, F = 16, 3584, 3072


def main():
    s = lambda kernel, **constexprs: sm90_compile.shared_bytes(kernel, constexprs, TYPES)
    out = {
        "mxfp8_quantize": s(tmx.mxfp8_quantize_kernel, N=L, BLOCK=tmx.BLOCK_Q),
        "decode_gate_up": s(tmx.mx_decode_gate_up_kernel, B1=4.0, B2=25.0, K=K, L=L, F=F, BLOCK_F=tmx.BLOCK_F1,
                            BLOCK_L=tmx.BLOCK_L1),
        "decode_down": s(tmx.mx_decode_down_kernel, K=K, L=L, F=F, BLOCK_L=tmx.BLOCK_L2, BLOCK_F=tmx.BLOCK_F2),
        "grouped_gate_up": s(tmx.mx_grouped_gate_up_kernel, B1=4.0, B2=25.0, L=L, F=F, DT=tl.bfloat16,
                             BLOCK_M=tmx.BLOCK_M, BLOCK_N=tmx.BLOCK_N, BLOCK_K=tmx.BLOCK_K),
        "grouped_down": s(tmx.mx_grouped_down_kernel, L=L, F=F, BLOCK_M=tmx.BLOCK_M, BLOCK_N=tmx.BLOCK_N,
                          BLOCK_K=tmx.BLOCK_K),
        "combine": s(tmx.mx_combine_kernel, K=K, L=L, BLOCK_L=tmx.BLOCK_Q),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
