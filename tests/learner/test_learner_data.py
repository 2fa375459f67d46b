"""Packing trajectories into micro-batches: alignment, no padding, token budget, DP shards."""

from __future__ import annotations

import pytest
import torch
from learner_helpers import make_trajectories

from k3rl.learner.data import LOSS_COLUMNS, build_micro_batches, pack_lengths, shard_micro_batches
from k3rl.types import Trajectory


def test_pack_lengths_respects_the_budget_and_places_every_sequence_once():
    lengths = [30, 5, 17, 64, 1, 12, 40, 8, 100]
    bins = pack_lengths(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 64 or len(b) == 1  # an over-long sequence rides alone
    assert [8] in bins  # 100 > 64: its own micro-batch
    assert pack_lengths(lengths, 64) == bins  # deterministic
    with pytest.raises(ValueError, match="budget"):
        pack_lengths(lengths, 0)


def test_positions_targets_masks_and_behaviour_logprobs_line_up():
    t1 = Trajectory(env_id="e", group_id="g", prompt_ids=[5, 6, 7], completion_ids=[8, 9, 10],
                    logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 0, 1], versions=[3, -1, 4])
    t2 = Trajectory(env_id="e", group_id="g", prompt_ids=[1], completion_ids=[2, 3],
                    logprobs=[-1.0, -2.0], loss_mask=[1, 1], versions=[0, 0])
    (mb,) = build_micro_batches([t1, t2], 64, "token_mean", advantages=torch.tensor([0.5, -1.0]))
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2]]  # L - 1 positions each, no padding
    assert mb.cu_seqlens.tolist() == [0, 5, 7]
    assert mb.targets.tolist() == [6, 7, 8, 9, 10, 2, 3]
    assert mb.mask.tolist() == [0, 0, 1, 0, 1, 1, 1]
    assert torch.allclose(mb.behaviour_logp, torch.tensor([0, 0, -0.1, -0.2, -0.3, -1.0, -2.0]))
    assert mb.advantages.tolist() == [0.5] * 5 + [-1.0] * 2
    assert mb.versions.tolist() == [-1, -1, 3, -1, 4, 0, 0]
    assert mb.seq_index.tolist() == [0] * 5 + [1] * 2
    assert torch.allclose(mb.agg_weights, mb.mask / 4)
    seq = build_micro_batches([t1, t2], 64, "seq_mean")[0]
    assert torch.allclose(seq.agg_weights, torch.tensor([0, 0, 0.25, 0, 0.25, 0.25, 0.25]))


def test_micro_batches_cover_the_batch_and_weights_sum_to_one():
    trajs = make_trajectories(0, n=12)
    mbs = build_micro_batches(trajs, 40, "seq_mean")
    assert len(mbs) > 1
    assert sorted(i for mb in mbs for i in mb.traj_indices) == list(range(12))
    total = sum(len(t.prompt_ids) + len(t.completion_ids) - 1 for t in trajs)
    assert sum(mb.num_tokens for mb in mbs) == total
    assert sum(float(mb.agg_weights.sum()) for mb in mbs) == pytest.approx(1.0, abs=1e-6)
    for mb in mbs:
        assert mb.num_tokens <= 40 or len(mb.traj_indices) == 1
        assert mb.cu_seqlens[-1].item() == mb.num_tokens


def test_deferred_loss_columns_equal_the_eager_ones_and_are_built_once():
    """defer=True: the forward's columns at once, the loss columns on ready() (segments included)."""
    trajs = make_trajectories(0, n=9)
    trajs[2] = trajs[2].model_copy(update={"segment_starts": [len(trajs[2].prompt_ids) + 1]})
    adv = torch.randn(9)
    eager = build_micro_batches(trajs, 40, "seq_mean", advantages=adv)
    lazy = build_micro_batches(trajs, 40, "seq_mean", advantages=adv, defer=True)
    assert len(lazy) == len(eager) > 1
    for a, b in zip(eager, lazy, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        assert b.mask is None and b.agg_weights is None  # nothing converted yet
        assert b.ready() is b and b.pending is None
        for name in LOSS_COLUMNS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert sum(float(mb.agg_weights.sum()) for mb in lazy) == pytest.approx(1.0, abs=1e-6)
    filler = build_micro_batches(trajs, 40, "seq_mean", defer=True)[0].zero_weight()  # a filler is built
    assert float(filler.mask.sum()) == 0 and filler.agg_weights.shape == filler.targets.shape


def test_routed_experts_fill_completion_positions_and_leave_the_rest_unknown():
    t = Trajectory(env_id="e", group_id="g", prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                   logprobs=[-1.0] * 3, loss_mask=[1] * 3, versions=[0] * 3,
                   routed_experts=[[[0, 1]], [], [[2, 3]]])
    (mb,) = build_micro_batches([t], 64, "token_mean", num_moe_layers=1, top_k=2)
    # positions 0..3; completion token j is an input at position P + j = 2 + j; the last token never is
    assert mb.routed_experts.shape == (1, 4, 1, 2)
    assert mb.routed_experts[0, :, 0].tolist() == [[-1, -1], [-1, -1], [0, 1], [-1, -1]]
    bad = t.model_copy(update={"routed_experts": [[[0, 1, 2]], [], []]})
    with pytest.raises(ValueError, match="routed_experts"):
        build_micro_batches([bad], 64, "token_mean", num_moe_layers=1, top_k=2)


def test_data_parallel_shards_have_equal_counts_with_zero_weight_fillers():
    mbs = build_micro_batches(make_trajectories(1, n=10), 35, "token_mean")
    assert len(mbs) == 5  # odd: rank 1 needs a filler
    shards = [shard_micro_batches(mbs, r, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == -(-len(mbs) // 2)
    real = [i for s in shards for mb in s for i in mb.traj_indices]
    assert sorted(real) == list(range(10))
    weight = sum(float(mb.agg_weights.sum()) for s in shards for mb in s)
    assert weight == pytest.approx(1.0, abs=1e-6)
    filler = shards[1][-1]
    assert filler.traj_indices == [] and float(filler.mask.sum()) == 0 and filler.num_tokens > 0


def test_bad_batches_raise():
    with pytest.raises(ValueError, match="no trajectories"):
        build_micro_batches([], 64, "token_mean")
    empty = Trajectory(env_id="e", prompt_ids=[1, 2])
    with pytest.raises(ValueError, match="no completion tokens"):
        build_micro_batches([empty], 64, "token_mean")
