"""Compile the routed tokens' dispatch and combine kernels for Hopper (sm_90) on the CPU at k3-small's
and K3's sizes; print each one's shared memory in bytes (JSON). Run as a script by test_route_kernels.py."""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import sm90_compile  # noqa: E402
import triton  # noqa: E402

from k3rl.kernels.moe import triton_routes as tr  # noqa: E402

TYPES = {**dict.fromkeys(["Y", "src", "X", "out"], "*bf16"), **dict.fromkeys(["w", "dw"], "*fp32"),
         "pos": "*i64", "N": "i32", "L": "i32"}  # fmt: skip


def main():
    out = {}
    for name, k, lat in (("k3-small", 4, 384), ("k3", 16, 3584)):
        for has_w in (True, False):
            c = dict(K=k, BN=tr.BN, BL=triton.next_power_of_2(lat), HAS_W=has_w)
            out[f"gather_sum_{name}_{has_w}"] = sm90_compile.shared_bytes(tr.gather_sum_kernel, c, TYPES)
            out[f"scatter_rows_{name}_{has_w}"] = sm90_compile.shared_bytes(tr.scatter_rows_kernel, c, TYPES)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
