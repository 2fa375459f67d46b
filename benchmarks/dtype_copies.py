"""Where a train step's dtype copies come from: every `aten._to_copy` / `aten.copy_` of one learner step
(forward, backward, optimizer) counted by the source line that caused it, with the bytes it wrote.

    python benchmarks/dtype_copies.py --preset k3-small --device cuda        # on the GPU
    python benchmarks/dtype_copies.py --preset k3-tiny --seq-len 256         # on the CPU (reference paths)

Under bf16 autocast the learner keeps fp32 parameters and mixes fp32 islands (norms, gates, states)
with bf16 matmuls; each boundary is a copy kernel. A copy's line is the innermost frame inside this
repository (autocast's own casts show as the line of the op they feed). Counted through a
TorchDispatchMode, so the step runs slower than usual: count here, time in `learner.py`.
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM
from learner import synthetic_batch  # benchmarks/learner.py, beside this file

COPIES = ("aten._to_copy", "aten.copy_")


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in COPIES:
            src = args[1] if name == "aten.copy_" else args[0]
            dst = args[0] if name == "aten.copy_" else out
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dtype != dst.dtype:
                here = [f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename
                        and "/benchmarks/dtype_copies.py" not in f.filename and "python3" not in f.filename]
                f = here[-1] if here else None
                where = f"{f.filename.split('/k3rl/')[-1].split('/main/')[-1]}:{f.lineno}  {f.line}" if f else "?"
                key = (where[:150], f"{src.dtype} -> {dst.dtype}".replace("torch.", ""))
                self.count[key] += 1
                self.bytes[key] += dst.numel() * dst.element_size()
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(K3Config.preset(args.preset))
    cfg = LearnerSection(micro_batch_tokens=args.seq_len, steps=4, bf16=True, routing_replay=False)
    trainer = Trainer(model, cfg, device=device)
    batch = synthetic_batch(4, args.seq_len, args.prompt_len, 0)
    trainer.train_step(batch)  # compile and warm up outside the count
    counter = CopyCounter()
    with counter:
        trainer.train_step(batch)
    total_n, total_b = sum(counter.count.values()), sum(counter.bytes.values())
    print(f"# dtype copies of one train step: {args.preset} on {device}, 4 x {args.seq_len} tokens, bf16 autocast")
    print(f"{total_n} copies, {total_b / 2**30:.2f} GiB written\n")
    print("| copies | GiB | dtypes | source line |")
    print("| --- | --- | --- | --- |")
    for key, b in counter.bytes.most_common(args.top):
        print(f"| {counter.count[key]} | {b / 2**30:.3f} | {key[1]} | `{key[0]}` |")


if __name__ == "__main__":
    main()
