"""Shared-prefix training (learner/prefix_tree.py): a group's common leading positions run once, forked to
every sample, give the loss and every parameter's gradient of packing each sample whole (CPU, k3-tiny with
chunk 16): groups of 1, 2 and 8, prefixes of 0 to 3 chunks plus a partial chunk, a shared earlier turn that
carries loss, routing replay, LoRA; and the fall-back where it cannot apply.

The equalities are checked with the model in fp64, each parameter to 1e-5 relative. The model keeps fp32
islands even then (the log-probs, beta, the short conv: docs/model.md's precision contract), so two fp64
computations of the same thing in another order differ by their rounding: packing the same sequences into
other micro-batches moves the worst parameter's gradient by 5e-7, the tree by 1.2e-6 (A_log, a sum with
much cancellation). Once in fp32: there the packed computation itself is 1.2e-5 (its worst parameter) from
the fp64 one, by rounding alone, and the tree no further; so fp32 is held to 1e-5 over the whole gradient
and 1e-4 a parameter. The fork itself is exact to fp64 rounding (tests/kernels: KDA's state, the conv
window, the prefix attention)."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from k3rl.config import LearnerSection, LoraSection
from k3rl.learner import Trainer
from k3rl.learner.prefix_tree import Document, build_tree
from k3rl.model import build_model
from k3rl.types import Trajectory

VOCAB, N_MOE, TOP_K, N_EXPERTS = 256, 7, 2, 8  # k3-tiny: 8 layers, the first dense; 8 experts, top 2; ids below the media pad (277)


@pytest.fixture(scope="module")
def tiny():
    return build_model("k3-tiny", seed=0).double()


def group(rng: random.Random, gid: str, size: int, prompt: int, shared_turn: int = 0, routes: bool = False):
    """`size` samples of one prompt of `prompt` tokens; with `shared_turn`, their completions start with the
    same `shared_turn` tokens (an earlier assistant turn, trained: loss mask 1, one behaviour log-prob)."""
    p = [rng.randrange(VOCAB) for _ in range(prompt)]
    turn = [rng.randrange(VOCAB) for _ in range(shared_turn)]
    turn_logp = [-rng.uniform(4.5, 6.5) for _ in turn]
    turn_routes = [[rng.sample(range(N_EXPERTS), TOP_K) for _ in range(N_MOE)] for _ in turn]
    out = []
    for i in range(size):
        C = rng.randint(2, 12)
        out.append(Trajectory(
            env_id="test/Synthetic-v0", group_id=gid, prompt_ids=p,
            completion_ids=turn + [rng.randrange(VOCAB) for _ in range(C)],
            logprobs=turn_logp + [-rng.uniform(4.5, 6.5) for _ in range(C)],
            loss_mask=[1] * shared_turn + [1 if rng.random() < 0.8 else 0 for _ in range(C)],
            versions=[0] * (shared_turn + C), reward=float(i % 3),
            routed_experts=(turn_routes + [[rng.sample(range(N_EXPERTS), TOP_K) for _ in range(N_MOE)]
                                           for _ in range(C)]) if routes else None,
        ))  # fmt: skip
    return out


def loss_and_grads(model, trajectories, shared: bool, **cfg):
    """The step's loss and every gradient (one update's forward + backward, no optimizer step)."""
    settings = dict(micro_batch_tokens=128, routing_replay=False, loss_agg="token_mean") | cfg
    torch.manual_seed(0)  # LoRA's adapters: the same initial values in both runs
    trainer = Trainer(copy.deepcopy(model), LearnerSection(shared_prefix=shared, **settings))
    adv = torch.tensor([t.reward for t in trajectories]) - 1.0  # a different advantage for each sample
    mbs, positions = trainer._micro_batches(trajectories, adv)
    sums: dict[str, torch.Tensor] = {}
    for mb in mbs:
        trainer._rl_micro_batch(mb, trainer._prepare(mb, False, trajectories), sums)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(sums["loss"]), grads, trainer, mbs, positions


def assert_same(trajectories, model, rel=1e-5, **cfg):
    """Loss and every gradient of the tree equal packing whole, each parameter within `rel` (relative)."""
    loss_a, grads_a, *_ = loss_and_grads(model, trajectories, False, **cfg)
    loss_b, grads_b, trainer, mbs, positions = loss_and_grads(model, trajectories, True, **cfg)
    assert abs(loss_b - loss_a) <= rel * abs(loss_a)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        err = (grads_b[name] - g).norm()
        assert err <= rel * g.norm(), f"{name}: error {err:.2e}, gradient norm {g.norm():.2e}"
    return trainer, mbs, positions


# prompts of 0, 1, 2 and 3 chunks of 16 plus a partial one (the shared positions are the prompt's P - 1)
@pytest.mark.parametrize("sizes, prompt", [([1, 1], 9), ([2], 22), ([8], 38), ([2, 8], 55)])
def test_tree_equals_packing_whole_loss_and_every_gradient(tiny, sizes, prompt):
    rng = random.Random(prompt)
    trajectories = [t for i, size in enumerate(sizes) for t in group(rng, f"g{i}", size, prompt + 3 * i)]
    trainer, mbs, positions = assert_same(trajectories, tiny)
    if max(sizes) > 1:
        assert any(mb.tree is not None and mb.tree.forks for mb in mbs)
        assert sum(mb.num_tokens for mb in mbs) < positions  # the prefix ran once


def test_fp32_within_its_rounding(tiny):
    model = copy.deepcopy(tiny).float()
    rng = random.Random(55)
    trajectories = group(rng, "a", 2, 55) + group(rng, "b", 8, 58, shared_turn=2)
    loss_a, grads_a, *_ = loss_and_grads(model, trajectories, False)
    loss_b, grads_b, *_ = loss_and_grads(model, trajectories, True)
    assert abs(loss_b - loss_a) <= 1e-5 * abs(loss_a)
    flat = lambda g: torch.cat([x.flatten() for x in g.values()])  # noqa: E731
    assert (flat(grads_b) - flat(grads_a)).norm() <= 1e-5 * flat(grads_a).norm()
    for name, g in grads_a.items():
        assert (grads_b[name] - g).norm() <= 1e-4 * g.norm(), name


def test_a_shared_earlier_turn_carries_loss_in_every_sample(tiny):
    """Two turns in common (a prompt and a trained assistant turn), then apart: the shared turn's tokens
    count once per sample (each with its advantage), and the gradient equals packing whole."""
    trajectories = group(random.Random(7), "g", 4, prompt=12, shared_turn=9)
    _, mbs, _ = assert_same(trajectories, tiny)
    (mb,) = mbs
    assert mb.tree.shared == 4 * (12 + 9 - 1) and float(mb.mask[mb.tree.index < mb.tree.root_tokens].sum()) == 4 * 9


def test_no_common_prefix_and_a_group_that_agrees_nowhere(tiny):
    """A group whose prompts differ at the first token shares nothing: every sample is a root of its own."""
    rng = random.Random(3)
    trajectories = group(rng, "a", 2, 6) + group(rng, "b", 1, 6)
    trajectories[1].group_id = "a"  # the second group's sample joins the first group, with another prompt
    trajectories[2].group_id = "a"
    _, mbs, _ = assert_same(trajectories, tiny)
    assert all(not mb.tree.forks or len(mb.tree.forks) == 1 for mb in mbs)


def test_routing_replay(tiny):
    """Recorded experts on the completions (the shared turn's the same in every sample): the prefix's records
    agree, the prompt's are probed (on the tree) and the rest replayed."""
    trajectories = group(random.Random(5), "g", 3, prompt=20, shared_turn=4, routes=True)
    _, mbs, _ = assert_same(trajectories, tiny, routing_replay=True)
    assert mbs[0].routed_experts is not None and mbs[0].tree.forks


def test_lora(tiny):
    lora = LoraSection(rank=4, alpha=8, targets=["attention", "shared_experts", "latent", "routed_experts"])
    trajectories = group(random.Random(9), "g", 2, prompt=18, shared_turn=3)
    assert_same(trajectories, tiny, lora=lora)


def test_train_step_logs_the_shared_fraction_and_the_tokens_saved(tiny):
    trajectories = group(random.Random(11), "g", 4, prompt=30) + group(random.Random(12), "h", 1, prompt=7)
    trainer = Trainer(copy.deepcopy(tiny), LearnerSection(shared_prefix=True, routing_replay=False, steps=2))
    metrics = trainer.train_step(trajectories)
    positions = sum(len(t.prompt_ids) + len(t.completion_ids) - 1 for t in trajectories)
    assert metrics["learner/shared_prefix_fraction"] == pytest.approx(4 * 29 / positions)
    assert metrics["learner/shared_prefix_tokens_saved"] == 3 * 29
    assert metrics["tokens"] == positions


def test_falls_back_to_packing_under_qk_clip(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="k3rl.learner.trainer"):
        trainer = Trainer(copy.deepcopy(tiny), LearnerSection(shared_prefix=True, qk_clip_tau=100.0))
    assert not trainer.shared_prefix and "packing every sequence whole instead: QK-Clip" in caplog.text
    mbs, _ = trainer._micro_batches(group(random.Random(1), "g", 2, 8), torch.zeros(2))
    assert all(mb.tree is None for mb in mbs)


def test_tree_layout():
    """Roots first (a shared prefix, a sequence of its own), then the branches by root; each unshared
    position maps to the tree position computing it."""
    docs = [Document(torch.tensor(x[:-1]), torch.tensor(x[1:]), None, g) for x, g in
            [([1, 2, 3, 4, 5], "a"), ([7, 8, 9], None), ([1, 2, 3, 6, 6, 6], "a")]]  # fmt: skip
    ids, targets, _, tree = build_tree(docs)
    assert tree.offsets == [0, 2, 4, 6, 9] and tree.roots == 2 and tree.forks == [(0, 2, 4)]
    assert ids.tolist() == [1, 2, 7, 8, 3, 4, 3, 6, 6] and targets.tolist() == [2, 3, 8, 9, 4, 5, 6, 6, 6]
    assert tree.index.tolist() == [0, 1, 4, 5, 2, 3, 0, 1, 6, 7, 8] and tree.shared == 4
