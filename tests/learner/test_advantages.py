"""Per-episode and per-turn advantages against hand-computed values, and episodes cut into context
segments trained as one episode (learner/advantages.py, learner/data.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from k3rl.config import LearnerSection
from k3rl.learner.advantages import step_advantages, token_advantages, turn_advantages, turn_returns
from k3rl.learner.data import build_micro_batches
from k3rl.learner.losses import group_advantages
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.types import Trajectory, Turn

torch.set_num_threads(1)


def test_discounted_returns():
    assert turn_returns([0.0, 1.0, 0.0, 2.0], 0.5) == [0.75, 1.5, 1.0, 2.0]
    assert turn_returns([1.0, 0.0, 1.0], 1.0) == [2.0, 1.0, 1.0]
    assert turn_returns([], 0.9) == []


def test_turn_baseline_is_the_group_mean_at_each_turn_index():
    rewards = [[1.0, 0.0, 1.0], [0.0, 1.0], [0.0, 0.0, 0.0, 3.0], [5.0]]
    groups = ["g", "g", "g", "h"]
    # returns (gamma 1): A [2, 1, 1], B [1, 1], C [3, 3, 3, 3]; D alone in its group
    no_std = turn_advantages(rewards, groups, 1.0, normalise=False)
    assert no_std[0] == pytest.approx([0.0, 1 - 5 / 3, -1.0])
    assert no_std[1] == pytest.approx([-1.0, 1 - 5 / 3])
    assert no_std[2] == pytest.approx([1.0, 3 - 5 / 3, 1.0, 0.0])  # turn 3: C alone, no baseline
    assert no_std[3] == [0.0]
    std1 = math.sqrt(4 / 3)  # unbiased std of [1, 1, 3]
    normed = turn_advantages(rewards, groups, 1.0, normalise=True)
    assert normed[0] == pytest.approx([0.0, (1 - 5 / 3) / std1, -1 / math.sqrt(2)], rel=1e-5)
    assert normed[1] == pytest.approx([-1.0, (1 - 5 / 3) / std1], rel=1e-5)  # std of [2, 1, 3] is 1
    assert normed[2] == pytest.approx([1.0, (4 / 3) / std1, 1 / math.sqrt(2), 0.0], rel=1e-5)


def test_terminal_rewards_of_equal_length_episodes_give_grpo():
    rewards = [0.2, 1.0, 0.0, 0.7]
    per_turn = turn_advantages([[0.0, 0.0, r] for r in rewards], ["g"] * 4, 1.0, normalise=True)
    grpo = group_advantages(rewards, ["g"] * 4, "grpo")
    for a, b in zip(per_turn, grpo.tolist(), strict=True):
        assert a == pytest.approx([b] * 3, rel=1e-6)


def segmented_episode(rng: random.Random, group: str, step_rewards: tuple[float, float], vocab: int = 256,
                      routes: tuple[int, int] | None = None) -> Trajectory:
    """An episode of two env turns in two context segments, the second opened by a summary turn:
    seg 0 = prompt, turn 1, tool reply, summary request, summary; seg 1 = rebuilt context, turn 2."""
    def ids(n):
        return [rng.randrange(vocab) for _ in range(n)]

    P = 5
    t = Trajectory(env_id="test/Seg-v0", group_id=group, prompt_ids=ids(P), reward=sum(step_rewards),
                   turns=[Turn(role="user", start=0, end=P)], routed_experts=[] if routes else None)

    def say(n, **kw):
        routed = [[[rng.randrange(8) for _ in range(routes[1])] for _ in range(routes[0])] for _ in range(n)] \
            if routes else None
        start, end = t.append(ids(n), generated=True, logprobs=[-rng.uniform(4, 6) for _ in range(n)], version=1,
                              routed=routed)
        t.turns.append(Turn(role="assistant", start=start, end=end, **kw))

    def hear(n, role="tool", **kw):
        start, end = t.append(ids(n), generated=False)
        t.turns.append(Turn(role=role, start=start, end=end, **kw))

    say(4, reward=step_rewards[0])
    hear(3)
    hear(2, role="user", compaction="summary_request")
    say(3, compaction="summary")
    t.segment_starts.append(len(t.token_ids))
    hear(6, role="user", compaction="carried", segment=1)
    say(5, reward=step_rewards[1], segment=1)
    return Trajectory.model_validate(t.model_dump())


def test_per_token_advantages_follow_the_turns():
    t = segmented_episode(random.Random(0), "g", (0.0, 1.0))
    adv = token_advantages(t, [0.5, -1.0])
    mask = torch.tensor(t.loss_mask, dtype=torch.float32)
    # completion: turn 1 (4 sampled), tool 3, request 2, summary (3 sampled), carried 6, turn 2 (5 sampled)
    expected = [0.5] * 4 + [0.0] * 5 + [-1.0] * 3 + [0.0] * 6 + [-1.0] * 5  # the summary: the next turn's
    assert adv.tolist() == expected and torch.equal(adv != 0, mask.bool())


def test_step_advantages_shapes_and_shaping():
    rng = random.Random(1)
    batch = [segmented_episode(rng, "g", r) for r in [(0.0, 1.0), (0.5, 0.0), (0.0, 0.0)]]
    episode = step_advantages(batch, [t.reward for t in batch], "grpo")
    assert episode.shape == (3,)
    assert torch.allclose(episode, group_advantages([1.0, 0.5, 0.0], ["g"] * 3, "grpo"))
    per_token = step_advantages(batch, [t.reward for t in batch], "turn_grpo_no_std", gamma=1.0)
    assert per_token.shape == (3, len(batch[0].completion_ids))
    # returns: [1, 1], [0.5, 0], [0, 0] -> turn 0 mean 0.5, turn 1 mean 1/3
    assert per_token[0, 0].item() == pytest.approx(0.5) and per_token[0, -1].item() == pytest.approx(2 / 3)
    assert per_token[1, 0].item() == pytest.approx(0.0) and per_token[1, -1].item() == pytest.approx(-1 / 3)
    # a penalty on the episode's reward (overlong shaping) lands on its last turn
    shaped = step_advantages(batch, [1.0, 0.5, -0.3], "turn_grpo_no_std", gamma=1.0)
    assert shaped[2, -1].item() == pytest.approx(-0.3 - (1.0 + 0.0 - 0.3) / 3)
    with pytest.raises(ValueError, match="no group_id"):
        step_advantages([batch[0].model_copy(update={"group_id": ""})], [1.0], "turn_grpo")


def three_turn_episode(group: str, rewards: list[float], malformed: list[bool]) -> Trajectory:
    """Assistant turns of 2 sampled tokens each, an env reply of 1 token after each but the last."""
    t = Trajectory(env_id="e", group_id=group, prompt_ids=[1, 2, 3])
    for k, (r, bad) in enumerate(zip(rewards, malformed, strict=True)):
        start, end = t.append([10 + k, 11 + k], generated=True, logprobs=[-1.0, -1.0])
        t.turns.append(Turn(role="assistant", start=start, end=end, reward=r, error="unparsable" if bad else None))
        t.reward += r
        if k < len(rewards) - 1:
            start, end = t.append([7], generated=False)
            t.turns.append(Turn(role="user", start=start, end=end))
    return t


def test_the_format_penalty_is_charged_to_the_malformed_turn():
    """A malformed answer (turn 2) that buys a retry (turn 3) vs a wrong answer: the penalty lowers the
    malformed turn's return, and not the retry turn's, which did nothing wrong."""
    batch = [three_turn_episode("g", [0.5, 0.0], [False, False]),               # lookup, wrong answer
             three_turn_episode("g", [0.5, 0.0, 0.5], [False, True, False]),    # lookup, malformed, right answer
             three_turn_episode("g", [0.5, 0.0, 0.0], [False, True, False])]    # lookup, malformed, wrong answer
    rewards = [t.reward for t in batch]
    plain = step_advantages(batch, rewards, "turn_grpo_no_std")
    # turn-2 returns: 0, 0.5, 0 (mean 1/6): the malformed turn that bought a right retry gets +1/3
    assert plain[1, 3].item() == pytest.approx(1 / 3)  # completion: turn 1 [0, 2), reply, turn 2 [3, 5)
    fixed = step_advantages(batch, rewards, "turn_grpo_no_std", format_penalty=0.3)
    # turn rewards now [0.5, 0], [0.5, -0.3, 0.5], [0.5, -0.3, 0]: turn-2 returns 0, 0.2, -0.3
    assert fixed[1, 3].item() == pytest.approx(0.2 - (0.0 + 0.2 - 0.3) / 3)
    assert fixed[2, 3].item() == pytest.approx(-0.3 - (0.0 + 0.2 - 0.3) / 3)
    # turn 3 (the two survivors, returns 0.5 and 0): unchanged by the penalty of turn 2
    assert fixed[1, -1].item() == pytest.approx(plain[1, -1].item()) == pytest.approx(0.25)
    # turn 1 sees it through the return (gamma 1): returns 0.5, 0.7, 0.2
    assert fixed[0, 0].item() == pytest.approx(0.5 - 1.4 / 3)
    # episode methods take the penalty in the rewards, not here
    assert torch.equal(step_advantages(batch, rewards, "grpo", format_penalty=0.3),
                       step_advantages(batch, rewards, "grpo"))


def test_segments_pack_as_their_own_sequences_under_the_episode():
    rng = random.Random(2)
    routes = (2, 3)  # routing replay: 2 MoE layers, top-3
    batch = [segmented_episode(rng, "g", (0.0, 1.0), routes=routes), segmented_episode(rng, "g", (0.0, 0.0), routes=routes)]
    (mb,) = build_micro_batches(batch, 4096, "token_mean", advantages=torch.tensor([0.7, -0.7]),
                                num_moe_layers=2, top_k=3)
    parts = [s for t in batch for s in t.segments()]
    (ref,) = build_micro_batches(parts, 4096, "token_mean", advantages=torch.tensor([0.7, 0.7, -0.7, -0.7]),
                                 num_moe_layers=2, top_k=3)
    for name in ("input_ids", "cu_seqlens", "targets", "mask", "behaviour_logp", "advantages", "versions",
                 "agg_weights", "routed_experts"):
        assert torch.equal(getattr(mb, name), getattr(ref, name)), name
    assert (mb.routed_experts >= 0).any()
    assert mb.seq_index.tolist() == [0] * (len(batch[0].token_ids) - 2) + [1] * (len(batch[1].token_ids) - 2)
    # every sampled token, summary included, is a target with the episode's advantage
    assert int(mb.mask.sum()) == sum(t.num_generated for t in batch) == 24


def test_train_step_with_turn_credit_over_segments():
    torch.manual_seed(0)
    rng = random.Random(3)
    batch = [segmented_episode(rng, f"g{i // 4}", (rng.random(), rng.random())) for i in range(8)]

    def step(advantage):
        torch.manual_seed(0)
        trainer = Trainer(K3ForCausalLM(K3Config.preset("k3-tiny")), LearnerSection(
            micro_batch_tokens=64, steps=10, advantage=advantage, turn_gamma=0.9))
        return trainer.train_step(batch)

    per_turn, per_episode = step("turn_grpo"), step("grpo")
    assert math.isfinite(per_turn["loss"]) and per_turn["sequences"] == 8
    assert per_turn["loss"] != pytest.approx(per_episode["loss"])  # the credit differs per turn
