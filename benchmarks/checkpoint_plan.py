"""Loading the release at K3 scale on a CPU, without its weights (results: BENCHMARKS.md, "Loading the release").

1. Names and bytes: the full `k3` preset on `meta` (bf16, fp32 allow-list) lists the release's 497,220
   names and its total size, from shapes alone.
2. A synthetic index of those 497,220 names (what `save_hf(experts="mxfp4")` would write, cut into
   small shards) resolves against the model (every name to its tensor, shapes checked), and
   `plan_loading` says which shards and bytes each rank of an 8-, 64- and 256-GPU learner reads
   (EP over the experts, FSDP over the rest; learner/expert_parallel.py).
3. The streaming loader for real: a checkpoint with the same 497,220 names but tiny widths (93 layers,
   896 experts of 32 x 32, 27 vision layers) is written in MXFP4 and loaded into a model, timing
   the header resolution and the load.
4. Memory: a k3-small checkpoint with MXFP4 experts is loaded into a bf16 model in a fresh process,
   streaming and, for comparison, the way the loader worked before (every tensor read first, then
   converted), sampling the resident memory every 5 ms.

    .venv/bin/python benchmarks/checkpoint_plan.py [--skip-files]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch

from k3rl.model import K3Config, build_model, save_hf
from k3rl.model.checkpoint import load_state_into, match_checkpoint, read_hf_tensors, stored_tensors
from k3rl.model.load_plan import expert_parallel_size, plan_loading, synthetic_index
from k3rl.model.state_dict_adapter import hf_layout

GB = 1e9
RELEASE_BYTES = 1_560.9e9  # the release's safetensors total (its index, 96 shards)


def rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes: allocations, and pages of mmap'd files such as open shards."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))


class PeakRSS:
    """Samples the resident set every 5 ms while the block runs: `added` is (anonymous, file-backed)
    peak minus start."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = tuple(map(max, self.peak, rss()))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = tuple(map(max, self.peak, rss()))

    @property
    def added(self) -> str:
        anon, file = (p - s for p, s in zip(self.peak, self.start, strict=True))
        return f"+{anon / 1e6:.0f} MB allocated, +{file / 1e6:.0f} MB of mapped shard pages"


def names_and_plans() -> None:
    t = time.perf_counter()
    state = build_model("k3", device="meta", dtype="bfloat16").state_dict()
    layout = hf_layout(state, experts="mxfp4")
    total = sum(t.nbytes for t in synthetic_index(layout, 1 << 62).values())
    experts = sum(1 for n in layout if ".experts." in n)
    print(f"k3 on meta: {len(layout):,} names ({len(layout) - experts:,} non-expert, {experts:,} expert), "
          f"{total / GB:,.1f} GB (the release's index: {RELEASE_BYTES / GB:,.1f} GB); {time.perf_counter() - t:.1f} s")
    for shard_gib in (1, 16):
        index = synthetic_index(layout, shard_gib << 30)
        t = time.perf_counter()
        match_checkpoint(index, state)
        print(f"\nshards of <= {shard_gib} GiB: {len({s.file for s in index.values()})} shards; "
              f"resolving all names against the model: {time.perf_counter() - t:.1f} s")
        print("| GPUs | EP | experts/rank | shards opened/rank | GB read/rank (experts) | GB held/rank bf16 | plan s |")
        print("|---|---|---|---|---|---|---|")
        for world in (8, 64, 256):
            ep = expert_parallel_size(896, world)
            t = time.perf_counter()
            plans = plan_loading(index, state, world, ep)
            dt = time.perf_counter() - t
            worst = max(plans, key=lambda p: p.read_bytes)
            opened = sorted(len(p.shards) for p in plans)
            print(f"| {world} | {ep} | {len(worst.experts)} | {opened[0]}-{opened[-1]} | "
                  f"{worst.read_bytes / GB:.1f} ({worst.expert_read_bytes / GB:.1f}) | {worst.held_bytes / GB:.1f} | {dt:.1f} |")


def tiny_widths() -> K3Config:
    """The full preset's structure (so its 497,220 names) with 32-wide everything."""
    raw = K3Config.preset("k3").model_dump()
    raw.update(hidden_size=64, vocab_size=320, media_placeholder_token_id=277, num_attention_heads=2,
               num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
               v_head_dim=16, moe_intermediate_size=32, routed_expert_hidden_size=32, intermediate_size=64)
    raw["linear_attn_config"].update(num_heads=2, head_dim=32)
    raw["vision_config"].update(vt_hidden_size=16, qkv_hidden_size=16, vt_num_attention_heads=2,
                                vt_intermediate_size=32, init_pos_emb_height=4, init_pos_emb_width=4, mm_hidden_size=16)
    return K3Config.model_validate(raw)


def streaming_load(workdir: Path) -> None:
    """Part 3: the loader over 497,220 real (tiny) tensors."""
    config = tiny_widths()
    t = time.perf_counter()
    model = build_model(config, dtype="bfloat16", seed=0)
    print(f"\nname-scale checkpoint: model built in {time.perf_counter() - t:.1f} s, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6:.0f} MB of parameters")
    t = time.perf_counter()
    save_hf(model, workdir, max_shard_bytes=1_500_000, experts="mxfp4")
    size = sum(f.stat().st_size for f in workdir.glob("*.safetensors"))
    stored = stored_tensors(workdir)
    print(f"save_hf(experts='mxfp4'): {time.perf_counter() - t:.1f} s, {len(stored):,} names in "
          f"{len({s.file for s in stored.values()})} shards, {size / 1e6:.0f} MB")
    del model, stored
    target = build_model(config, dtype="bfloat16", seed=1)
    t = time.perf_counter()
    match_checkpoint(stored_tensors(workdir), dict(target.state_dict()))
    print(f"headers read and every name resolved: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    load_state_into(target, workdir)
    print(f"load_state_into (headers, resolution, then streaming with MXFP4 dequantised): {time.perf_counter() - t:.1f} s")


def memory(workdir: Path) -> None:
    """Part 4: what loading adds to the process's memory beside the model, each way in a fresh process."""
    model = build_model("k3-small", dtype="bfloat16", seed=0)
    save_hf(model, workdir, experts="mxfp4", max_shard_bytes=50_000_000)
    size = sum(f.stat().st_size for f in workdir.glob("*.safetensors"))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nk3-small, bf16 model of {held / 1e6:.0f} MB, checkpoint with MXFP4 experts {size / 1e6:.0f} MB "
          f"in {len(list(workdir.glob('*.safetensors')))} shards of <= 50 MB:")
    for how in ("stream", "read-all"):
        out = subprocess.run([sys.executable, __file__, "--measure", how, str(workdir)], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
        print(f"  {how}: {out}")


def measure(how: str, workdir: Path) -> None:
    """In a fresh process: build the model, then load `workdir` one way; print the memory it added."""
    from k3rl.model.state_dict_adapter import from_hf

    torch.set_num_threads(1)
    model = build_model(K3Config.from_hf(workdir), dtype="bfloat16", seed=1)
    with PeakRSS() as mem:
        t = time.perf_counter()
        if how == "stream":
            load_state_into(model, workdir)
        else:  # what load_state_into did before it streamed: read every tensor, then convert all of them
            state, _ = from_hf(read_hf_tensors(workdir), model.state_dict(), fill_missing_experts=False)
            model.load_state_dict(state)
            del state
        dt = time.perf_counter() - t
    print(f"{dt:.1f} s, {mem.added} at the peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-files", action="store_true", help="only the index-based parts 1-2")
    parser.add_argument("--measure", nargs=2, metavar=("HOW", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure[0], Path(args.measure[1]))
    torch.set_num_threads(1)
    print(f"{date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    names_and_plans()
    if not args.skip_files:
        for part in (streaming_load, memory):
            workdir = Path(tempfile.mkdtemp(prefix="k3-checkpoint-"))
            try:
                part(workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
