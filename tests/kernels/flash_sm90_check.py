"""Compile the flash attention kernels (kernels/attention/triton_flash.py) for Hopper (sm_90) on the CPU at
MLA's head dims (q/k 192, v 128), bf16 inputs (the learner's), with the launch settings; print each one's shared memory in bytes (JSON).
Run as a script by test_flash_attention.py."""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import sm90_compile  # noqa: E402
import triton  # noqa: E402

from k3rl.kernels.attention import triton_flash as tf  # noqa: E402


def main():
    out = {}
    D, DV = 192, 128
    for dtype in ("bf16",):
        types = {**dict.fromkeys(["q", "k", "v", "kp", "vp", "do"], f"*{dtype}"),
                 **dict.fromkeys(["o", "lse", "delta", "dq", "dk", "dv", "dkp", "dvp"], "*fp32"),
                 "cu": "*i32", "scale": "fp32", "H": "i32", "P": "i32", "T": "i32"}
        c = dict(D=D, DV=DV, BD=triton.next_power_of_2(D), BDV=DV, BM=tf.BLOCK_M, BN=tf.BLOCK_N, IEEE=dtype == "fp32")
        for name, kernel in (("fwd", tf.flash_fwd_kernel), ("bwd_q", tf.flash_bwd_q_kernel),
                             ("bwd_kv", tf.flash_bwd_kv_kernel), ("bwd_prefix", tf.flash_bwd_prefix_kernel)):
            out[f"{name}_{dtype}"] = sm90_compile.shared_bytes(kernel, c, types, **tf.LAUNCH)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
