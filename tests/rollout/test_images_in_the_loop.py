"""Images through the whole loop: a screenshot a tool returns reaches the engine as pixels, the engine's
log-probs of the turn after it are the learner's on the same tokens (fp32, CPU), and a conversation's
images are each encoded once by the engine, however many turns follow them."""

from __future__ import annotations

import asyncio
import copy

import gymnasium as gym
import pytest
import torch

import k3rl.envs  # noqa: F401
from k3rl.chat import ChatTemplate
from k3rl.config import LearnerSection
from k3rl.learner.trainer import Trainer
from k3rl.model import K3Config, K3ForCausalLM
from k3rl.rollout.engine import EmbeddedEngine
from k3rl.rollout.episode import EpisodeSpec, run_episode, scripted_generate
from k3rl.types import SamplingParams

torch.set_num_threads(1)
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    with torch.no_grad():  # a sharper head than the init's, so the sampled turn has structure
        model.lm_head.weight.mul_(8.0)
    return model


def screen_episodes(model, n: int):
    """ScreenRead episodes whose first turn is the oracle's call (scripted) and whose second turn, after
    the screenshot, the engine samples."""
    template = ChatTemplate()
    engine = EmbeddedEngine(model, background=False)
    trajs = []
    for seed in range(n):
        env = gym.make("k3rl/ScreenRead-v0", template=template, max_turns=2)
        oracle = scripted_generate(template, lambda env=env: env.unwrapped.oracle())
        calls = []

        async def generate(ids, sampling, images=None, oracle=oracle, calls=calls, **kw):
            calls.append(images)
            if len(calls) == 1:
                return await oracle(ids, sampling, images=images, **kw)
            return engine.generate(ids, sampling.model_copy(update={"max_tokens": 12, "stop_token_ids": []}),
                                   images=images)

        spec = EpisodeSpec(id=f"img-{seed}", env_id="k3rl/ScreenRead-v0", seed=seed)
        traj = asyncio.run(run_episode(lambda env=env: env, spec, generate, template,
                                       SamplingParams(temperature=TEMPERATURE, max_tokens=160), max_turns=2,
                                       max_context_tokens=1024))
        assert traj.error is None and calls[0] is None and len(calls[1]) == 1  # the screenshot reached the engine
        trajs.append(traj)
    return trajs


def test_engine_logprobs_after_a_screenshot_equal_the_learners(model):
    trajs = screen_episodes(model, 4)
    trainer = Trainer(copy.deepcopy(model), LearnerSection(micro_batch_tokens=4096), temperature=TEMPERATURE)
    learner = trainer.logprobs(trajs)
    worst = 0.0
    for traj, lp in zip(trajs, learner, strict=True):
        after = [i for i, t in enumerate(traj.turns) if t.role == "tool"][0]
        turn = traj.turns[after + 1]  # the sampled answer, after the image
        P = len(traj.prompt_ids)
        positions = [i - P for i in range(turn.start, turn.end) if i >= P and traj.loss_mask[i - P]]
        assert len(positions) >= 10
        engine = torch.tensor([traj.logprobs[i] for i in positions], dtype=torch.float64)
        mine = torch.tensor([lp[i] for i in positions], dtype=torch.float64)
        assert (engine < -1e-3).any()  # real sampled tokens, not scripted ones (log-prob 0)
        worst = max(worst, float((engine - mine).abs().max()))
    assert worst < 1e-4, worst
    # the pixels matter to both: blank the screenshots and the learner's log-probs move
    blank = copy.deepcopy(trajs)
    from k3rl.envs.screen_read import png

    for t in blank:
        for turn in t.turns:
            if turn.images:
                turn.images = [png(torch.zeros(28, 56, 3, dtype=torch.uint8).numpy())]
    moved = trainer.logprobs(blank)
    assert max(abs(a - b) for x, y in zip(learner, moved, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3


def test_a_conversations_images_are_each_encoded_once(model):
    """Three screenshots over four turns, the engine asked at every turn for the whole conversation so far
    (as the episode loop asks it): each image goes through MoonViT once. The turn after an image finds the
    state of the prompt before it in the prefix cache, images included, and encodes only the new one."""
    template = ChatTemplate()
    engine = EmbeddedEngine(model, background=False)
    env = gym.make("k3rl/ScreenRead-v0", template=template, max_turns=4)
    base, asked = env.unwrapped, []

    def act():
        if len(asked) <= 3:  # show a panel after each turn's request (the third repeats the first: a new image)
            return base.say(tool_calls=[{"name": "show", "arguments": {"panel": base.task.panels[len(asked) % 2]}}])
        return base.say("done")

    scripted = scripted_generate(template, act)

    async def generate(ids, sampling, images=None, **kw):
        asked.append(len(images or []))
        engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1), images=images)
        return await scripted(ids, sampling, images=images, **kw)

    spec = EpisodeSpec(id="img-once", env_id="k3rl/ScreenRead-v0", seed=3)
    traj = asyncio.run(run_episode(lambda: env, spec, generate, template, SamplingParams(max_tokens=160),
                                   max_turns=4, max_context_tokens=1024))
    assert traj.error is None and asked == [0, 1, 2, 3] and len(traj.images) == 3
    m = engine.metrics()
    assert m["images_encoded"] == 3  # not 0 + 1 + 2 + 3 = 6
    assert m["prefix_hit_images"] == 0 + 1 + 2  # the earlier turns' images came with their cached states
    assert m["vision_s"] > 0
