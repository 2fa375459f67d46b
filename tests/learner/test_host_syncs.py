"""The host does not wait for the GPU inside a train step: cu_seqlens is read once (or handed over by
the host that built it), micro-batches are copied without a wait, statistics are read at the end."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from learner_helpers import make_trajectories

from k3rl.config import LearnerSection
from k3rl.kernels.varlen import (
    host_copy,
    host_offsets,
    pad_documents,
    remember_host_copy,
    remember_host_offsets,
    unpad_documents,
)
from k3rl.learner.host_syncs import host_syncs
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM


def test_host_offsets_are_read_once_per_tensor_and_again_after_an_in_place_write():
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    assert host_offsets(cu) == [0, 3, 7, 12]
    remember_host_offsets(cu, [0, 3, 7, 12])
    assert host_offsets(cu) == [0, 3, 7, 12]
    cu[1] = 5  # an in-place write bumps the tensor's version: the cached values are not used
    assert host_offsets(cu) == [0, 5, 7, 12]
    other = torch.tensor([0, 2, 12], dtype=torch.int32)  # another tensor: its own values
    assert host_offsets(other) == [0, 2, 12]
    # the padded layout follows the host values: 3 documents of 5, 2 and 5 tokens
    x = torch.arange(12.0).reshape(1, 12, 1)
    padded = pad_documents(x, cu)
    assert padded.shape == (3, 5, 1)
    assert padded[1, :2, 0].tolist() == [5.0, 6.0] and padded[1, 2:, 0].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(unpad_documents(padded, cu), x)


def test_host_copy_is_the_handed_over_copy_until_an_in_place_write():
    ids = torch.tensor([[5, 6, 7]])
    assert host_copy(ids) is ids  # a CPU tensor is its own host copy
    # on the CPU the engine hands a tensor over as its own copy: it is still freed when dropped
    own = torch.tensor([[1, 2]])
    remember_host_copy(own, own)
    gone = weakref.ref(own)
    del own
    gc.collect()
    assert gone() is None
    # a tensor with no data to read (meta): the host copy handed over is returned without a device read
    dev = remember_host_copy(torch.empty(1, 3, dtype=torch.long, device="meta"), ids)
    assert host_copy(dev) is ids
    dev.add_(1)  # an in-place write bumps its version: the copy is stale, so the device is read (meta: fails)
    with pytest.raises(NotImplementedError):
        host_copy(dev)
    with pytest.raises(NotImplementedError):  # another tensor: never that copy
        host_copy(torch.empty(1, 3, dtype=torch.long, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_train_step_on_cuda_waits_for_the_gpu_only_at_its_ends():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny"))
    # one micro-batch a step, no reference or old-policy forward: one forward and one backward; in bf16,
    # as a job on a GPU trains (the grouped expert GEMMs; the fp32 path loops over the experts on the host)
    trainer = Trainer(model, LearnerSection(micro_batch_tokens=4096, steps=3, bf16=True), device="cuda")
    trainer.train_step(make_trajectories(0, n=8))  # warm-up: allocations, kernel compilation
    waits = host_syncs(lambda: trainer.train_step(make_trajectories(1, n=8)))
    # the gradient norm and the statistics (two reads) after the optimizer; before: one or more in every
    # layer, one per statistic after the backward, and the media-placeholder check in every forward
    assert sum(waits.values()) <= 3, waits
