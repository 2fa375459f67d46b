"""CUDA graphs of the engine when its latent buffers grow, and under autocast (skipped without a GPU).

A sequence that outgrows the state pool's first latent capacity (256 tokens) moves the buffers,
so every captured graph is dropped and decode is captured again: on a new memory pool (reusing
the old pool, whose graphs are all gone, failed an internal assert of PyTorch's allocator in the
first H200 run of benchmarks/mismatch.py). On the GPU image run it with
`python3 -m pytest tests/rollout/test_engine_graphs_regrow.py`."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import build_model
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]


def _generate(model, enforce_eager: bool, **kw) -> list[list[int]]:
    prompts = [[(7 * i + 3 + j) % 250 + 1 for i in range(200)] for j in range(3)]
    with EmbeddedEngine(model, background=False, enforce_eager=enforce_eager, max_num_seqs=4, prefill_graphs=False,
                        **kw) as eng:
        futures = [eng.submit(p, SamplingParams(temperature=0.0, max_tokens=120)) for p in prompts]
        while not all(f.done() for f in futures):
            eng.step()
        if not enforce_eager:
            assert eng.scheduler.pool.generation >= 1 and eng.scheduler.decoder.graphs  # grew, and decoded by new graphs
        return [f.result().token_ids for f in futures]


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_graph_decode_past_the_first_latent_capacity_equals_eager(mode):
    model = build_model("k3-tiny", None, seed=0, device="cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # clear argmax margins: padded and unpadded batches pick the same tokens
    kw = {"autocast_dtype": torch.bfloat16} if mode == "autocast" else {}
    if mode == "bf16":
        model.to_param_dtype(torch.bfloat16)
    graphs = _generate(model, False, **kw)
    assert all(len(t) == 120 for t in graphs)
    assert graphs == _generate(model, True, **kw)
