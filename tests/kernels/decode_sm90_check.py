"""Compile the engine's decode kernels (the router's top-k, the routed experts of a small batch) for
Hopper (sm_90) on the CPU at k3-small's and K3's sizes with their launch settings; print each one's
shared memory in bytes (JSON). Run as a script by test_router_kernel.py, so that TRITON_INTERPRET=1
elsewhere does not matter; catches what the interpreter cannot (a construct the compiler refuses)."""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import sm90_compile  # noqa: E402
import triton  # noqa: E402

from k3rl.kernels.moe import triton_decode_experts as de  # noqa: E402
from k3rl.kernels.moe import triton_router as tr  # noqa: E402

TYPES = {  # argument -> Triton type: bf16 activations and weights, fp32 router logits and weights
    **dict.fromkeys(["z", "w1", "w3", "w2", "a", "y"], "*bf16"),
    **dict.fromkeys(["l_ptr", "b_ptr", "p_ptr", "p"], "*fp32"),
    **dict.fromkeys(["i_ptr", "idx"], "*i64"),
    "E": "i32",
    "scaling": "fp32",
}


def shared_bytes(kernel, constexprs, num_warps=4, num_stages=3):
    return sm90_compile.shared_bytes(kernel, constexprs, TYPES, num_warps, num_stages)


def main():
    out = {}
    for name, E, k, lat, f in (("k3-small", 32, 4, 384, 256), ("k3", 896, 16, 3584, 2048)):
        warps = 4 if E > 256 else 1
        out[f"route_topk_{name}"] = shared_bytes(tr.route_topk_kernel, dict(
            TOP_K=k, RENORM=True, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k)), warps)
        out[f"gate_up_{name}"] = shared_bytes(de.gate_up_kernel, dict(
            B1=4.0, B2=25.0, K=k, L=lat, F=f, BLOCK_F=de.BLOCK_F1, BLOCK_L=de.BLOCK_L1))
        out[f"down_combine_{name}"] = shared_bytes(de.down_combine_kernel, dict(
            K=k, L=lat, F=f, BLOCK_L=de.BLOCK_L2, BLOCK_F=de.BLOCK_F2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
