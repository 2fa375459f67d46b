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
import yaml
from PIL import Image

from k3rl.config import LearnerSection, LoraSection
from k3rl.images import to_png
from k3rl.learner import Trainer
from k3rl.learner.prefix_tree import Document, build_tree
from k3rl.model import build_model
from k3rl.types import Trajectory, Turn

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


def loss_and_grads(model, trajectories, shared: bool, device=None, **cfg):
    """The step's loss and every gradient (one update's forward + backward, no optimizer step)."""
    settings = dict(micro_batch_tokens=128, routing_replay=False, loss_agg="token_mean") | cfg
    torch.manual_seed(0)  # LoRA's adapters: the same initial values in both runs
    trainer = Trainer(copy.deepcopy(model), LearnerSection(shared_prefix=shared, **settings), device=device)
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
    assert metrics["learner/shared_prefix_saved_fraction"] == pytest.approx(3 * 29 / positions)
    assert metrics["learner/shared_prefix_tokens_saved"] == 3 * 29
    assert metrics["learner/shared_prefix_used"] == 1.0
    assert metrics["tokens"] == positions


def test_auto_uses_the_tree_above_the_threshold_only(tiny):
    """shared_prefix: auto (the default) packs whole while the tree would save no more than
    shared_prefix_min_fraction of the positions, and logs what it would have saved."""
    assert LearnerSection().shared_prefix == "auto"
    trajectories = group(random.Random(11), "g", 4, prompt=30)  # 3 x 29 positions saved
    positions = sum(len(t.prompt_ids) + len(t.completion_ids) - 1 for t in trajectories)
    saved = 3 * 29 / positions
    for threshold, used in ((saved - 0.01, True), (saved + 0.01, False)):
        trainer = Trainer(copy.deepcopy(tiny), LearnerSection(shared_prefix_min_fraction=threshold))
        mbs, _ = trainer._micro_batches(trajectories, torch.zeros(4))
        assert all((mb.tree is not None) == used for mb in mbs)
        metrics = trainer._prefix_metrics()
        assert metrics["learner/shared_prefix_saved_fraction"] == pytest.approx(saved)
        assert metrics["learner/shared_prefix_tokens_saved"] == (3 * 29 if used else 0)
        assert metrics["learner/shared_prefix_used"] == float(used)
    never = Trainer(copy.deepcopy(tiny), LearnerSection(shared_prefix=False))
    assert all(mb.tree is None for mb in never._micro_batches(trajectories, torch.zeros(4))[0])
    assert never._prefix_metrics() == {}


def test_old_boolean_settings_still_load():
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        assert LearnerSection.model_validate(yaml.safe_load(f"shared_prefix: {text}")).shared_prefix == value
    with pytest.raises(ValueError):
        LearnerSection(shared_prefix="sometimes")


def test_falls_back_to_packing_under_qk_clip(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="k3rl.learner.trainer"):
        trainer = Trainer(copy.deepcopy(tiny), LearnerSection(shared_prefix=True, qk_clip_tau=100.0))
    assert not trainer.shared_prefix and "packing every sequence whole instead: QK-Clip" in caplog.text
    mbs, _ = trainer._micro_batches(group(random.Random(1), "g", 2, 8), torch.zeros(2))
    assert all(mb.tree is None for mb in mbs)


def test_auto_falls_back_with_one_log_line(tiny, caplog):
    """Under auto (not asked for outright) a fall-back is said once, at info, and never again a step; so is
    the packing whole of trajectories with both images and context segments."""
    with caplog.at_level(logging.INFO, logger="k3rl.learner.trainer"):
        qk = Trainer(copy.deepcopy(tiny), LearnerSection(qk_clip_tau=100.0))
        for _ in range(2):
            assert all(mb.tree is None for mb in qk._micro_batches(group(random.Random(1), "g", 2, 8),
                                                                   torch.zeros(2))[0])  # fmt: skip
        (one,) = group(random.Random(2), "s", 1, 12)
        picture = Turn(role="user", images=[to_png(Image.new("RGB", (28, 28)))], start=0, end=len(one.prompt_ids))
        with_image = [Trajectory(**one.model_dump() | {"turns": [picture], "segment_starts": [len(one.prompt_ids) + 1]})]
        auto = Trainer(copy.deepcopy(tiny), LearnerSection())
        for _ in range(2):
            mbs, _ = auto._micro_batches(group(random.Random(3), "g", 2, 20) + with_image, torch.zeros(3))
            assert any(mb.tree is not None for mb in mbs)
    lines = [r for r in caplog.records if "shared_prefix" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    assert "QK-Clip" in lines[0].getMessage() and "both images and context segments are packed whole" in lines[1].getMessage()


def test_compacted_episodes_share_their_first_segment(tiny):
    """A group of long-horizon episodes whose context was compacted (segment_starts: each later segment a
    context of its own) beside unsegmented members: the first segments share the group's prompt, the later
    segments stay whole documents, and the loss and every gradient equal packing whole. Routing replay on."""
    rng = random.Random(17)
    trajectories = group(rng, "g", 4, prompt=21, shared_turn=2, routes=True)
    for t in trajectories[:3]:  # the last keeps one context
        t.segment_starts = [len(t.token_ids)]  # a new context: the task's first tokens again, then its own
        t.completion_ids += t.prompt_ids[:6] + [rng.randrange(VOCAB) for _ in range(5)]
        t.logprobs += [0.0] * 6 + [-rng.uniform(4.5, 6.5) for _ in range(5)]
        t.loss_mask += [0] * 6 + [1] * 5
        t.versions += [0] * 11
        t.routed_experts += [[rng.sample(range(N_EXPERTS), TOP_K) for _ in range(N_MOE)] for _ in range(11)]
    _, mbs, positions = assert_same(trajectories, tiny, routing_replay=True)
    (mb,) = mbs
    assert mb.tree.forks and mb.tree.shared == 4 * (21 + 2 - 1)  # the prompt and the shared turn, once
    assert mb.tree.roots == 1 + 3  # the shared prefix, and the three later segments whole


def test_tree_layout():
    """Roots first (a shared prefix, a sequence of its own), then the branches by root; each unshared
    position maps to the tree position computing it."""
    docs = [Document(torch.tensor(x[:-1]), torch.tensor(x[1:]), None, g) for x, g in
            [([1, 2, 3, 4, 5], "a"), ([7, 8, 9], None), ([1, 2, 3, 6, 6, 6], "a")]]  # fmt: skip
    ids, targets, _, tree = build_tree(docs)
    assert tree.offsets == [0, 2, 4, 6, 9] and tree.roots == 2 and tree.forks == [(0, 2, 4)]
    assert ids.tolist() == [1, 2, 7, 8, 3, 4, 3, 6, 6] and targets.tolist() == [2, 3, 8, 9, 4, 5, 6, 6, 6]
    assert tree.index.tolist() == [0, 1, 4, 5, 2, 3, 0, 1, 6, 7, 8] and tree.shared == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_cuda_within_bf16_tolerance():
    """On CUDA (the Triton kernels: chunk KDA with a state a document, the short conv with a window a
    document, the prefix attention) under bf16 autocast, the tree's loss and gradients are as close to
    the fp32 packed computation as packing whole in bf16 is: bf16's own error, measured here as packed bf16
    against packed fp32, bounds the tree's (3x, plus 1% of each gradient: two roundings of one computation
    in another order). k3-tiny in fp32 master weights, groups of 8 and 2 with prompts of 2 chunks and a
    partial one, a shared trained turn, routing replay on."""
    model = build_model("k3-tiny", seed=0).cuda()
    rng = random.Random(25)
    trajectories = group(rng, "g", 8, prompt=40, shared_turn=3, routes=True) + group(rng, "h", 2, prompt=21)
    cfg = dict(micro_batch_tokens=512, routing_replay=True, device="cuda")
    loss_ref, grads_ref, *_ = loss_and_grads(model, trajectories, False, bf16=False, **cfg)
    loss_bf16, grads_bf16, *_ = loss_and_grads(model, trajectories, False, bf16=True, **cfg)
    loss_tree, grads_tree, _, mbs, positions = loss_and_grads(model, trajectories, True, bf16=True, **cfg)
    assert any(mb.tree is not None and mb.tree.forks for mb in mbs)
    assert abs(loss_tree - loss_ref) <= 3 * abs(loss_bf16 - loss_ref) + 1e-2 * abs(loss_ref)
    flat = lambda grads: torch.cat([grads[n].float().flatten() for n in sorted(grads)])  # noqa: E731
    ref, bf16, tree = flat(grads_ref), flat(grads_bf16), flat(grads_tree)
    # over the whole gradient: |tree - ref| <= 3 |packed bf16 - ref| + 1% |ref|
    assert (tree - ref).norm() <= 3 * (bf16 - ref).norm() + 1e-2 * ref.norm()
    for name, g in grads_ref.items():
        err, own = (grads_tree[name] - g).norm(), (grads_bf16[name] - g).norm()
        assert err <= 3 * own + 1e-2 * g.norm(), f"{name}: tree {err:.2e}, packed bf16 {own:.2e}, norm {g.norm():.2e}"


def _with_picture(t: Trajectory, model, color, where: str, seed: int) -> Trajectory:
    """t with an image of `color`: in its prompt (after the first 5 tokens) or in a tool result after its
    completion's first 3 tokens (placeholders untrained, then 4 more generated tokens)."""
    img = Image.new("RGB", (56, 42), color)
    pads = [model.config.media_placeholder_token_id] * int(model.as_media([img]).tokens_per_item()[0])
    rng = random.Random(seed)
    if where == "prompt":
        prompt = t.prompt_ids[:5] + pads + t.prompt_ids[5:]
        return t.model_copy(update={"prompt_ids": prompt, "turns": [
            Turn(role="user", images=[to_png(img)], start=0, end=len(prompt))]})
    more = [rng.randrange(VOCAB) for _ in range(4)]
    head = t.completion_ids[:3]
    start = len(t.prompt_ids) + 3
    return t.model_copy(update={
        "completion_ids": head + pads + more + t.completion_ids[3:],
        "logprobs": t.logprobs[:3] + [0.0] * len(pads) + [-5.0] * 4 + t.logprobs[3:],
        "loss_mask": t.loss_mask[:3] + [0] * len(pads) + [1] * 4 + t.loss_mask[3:],
        "versions": t.versions[:3] + [0] * (len(pads) + 4) + t.versions[3:],
        "turns": [Turn(role="tool", images=[to_png(img)], start=start, end=start + len(pads))]})


def test_images_after_the_shared_prefix_train_exactly(tiny):
    """Vision episodes: a group whose images arrive in tool results after a shared prompt and trained turn
    (each sample its own picture, one none), beside a group whose prompt holds an image (sharing stops before
    it: equal placeholder ids say nothing of the pixels) and an ungrouped image episode. The tree stream
    carries the images in its own order; the loss and every gradient equal packing whole."""
    rng = random.Random(23)
    colors = [(200, 30, 30), (20, 30, 230), (30, 200, 30), None]
    shared_turn = group(rng, "g", 4, prompt=18, shared_turn=2)
    vision = [t if c is None else _with_picture(t, tiny, c, "tool", seed=i)
              for i, (t, c) in enumerate(zip(shared_turn, colors, strict=True))]
    in_prompt = [_with_picture(t, tiny, (90, 90, 9 * i), "prompt", seed=i) for i, t in enumerate(group(rng, "h", 2, 12))]
    alone = _with_picture(group(rng, "solo", 1, 7)[0], tiny, (1, 2, 3), "tool", seed=9)
    trajectories = vision + in_prompt + [alone]
    _, mbs, _ = assert_same(trajectories, tiny, micro_batch_tokens=4096)
    (mb,) = mbs
    assert len(mb.images) == 6 and mb.tree.forks
    assert mb.tree.shared == 4 * (18 + 2 - 1) + 2 * 5  # g's prompt and turn; h's text before its image
