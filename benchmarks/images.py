"""Images through the loop, measured: tokens per image, MoonViT's time in the engine (forward, no grad) and in
the learner (forward + backward), and the memory an episode holds at 10 images (its decoding state: the KDA
layers' fixed state plus the MLA layers' latents per token, image tokens included; and its PNG bytes).

    python benchmarks/images.py                         # k3-tiny on the CPU
    python benchmarks/images.py --preset k3-small --device cuda --dtype bfloat16

The episode is a real k3rl/ScreenRead-v0 conversation through the episode loop (a scripted policy shows a
panel 10 times), prefilled by the model into a cache; the sizes are those of ScreenRead's screenshots
(56 x 28) and of larger screens for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import gymnasium as gym
import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

import k3rl.envs  # noqa: F401 - registers the built-in envs
from k3rl.chat import ChatTemplate
from k3rl.images import from_png
from k3rl.model import build_model, preprocess_media
from k3rl.rollout.episode import EpisodeSpec, run_episode, scripted_generate
from k3rl.types import SamplingParams

SIZES = [(56, 28), (224, 224), (448, 448), (1024, 768)]


def timed(fn, repeat: int, device: str) -> float:
    """Median seconds of `fn()` over `repeat` runs after one warm-up."""
    fn()
    out = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def screen_episode(shows: int):
    """A ScreenRead conversation in which a scripted policy shows a panel `shows` times, then answers."""
    template = ChatTemplate()
    env = gym.make("k3rl/ScreenRead-v0", template=template, max_turns=shows + 1)
    base, turns = env.unwrapped, []

    def act():
        turns.append(1)
        if len(turns) <= shows:
            return base.say(tool_calls=[{"name": "show", "arguments": {"panel": base.task.panels[len(turns) % 2]}}])
        return base.say("done")

    spec = EpisodeSpec(id="images-bench", env_id="k3rl/ScreenRead-v0", seed=0)
    return asyncio.run(run_episode(lambda: env, spec, scripted_generate(template, act), template,
                                   SamplingParams(max_tokens=160), max_turns=shows + 1, max_context_tokens=8192))


def cache_bytes(cache) -> tuple[int, int]:
    """(fixed bytes: the KDA states and conv windows, bytes per token: the MLA latents) of a batch-1 cache."""
    fixed = sum(e.state.nbytes + e.conv.nbytes for e in cache.kda.values())
    per_token = sum(e.latent.shape[-1] * e.latent.element_size() for e in cache.mla.values())
    return fixed, per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(args.preset, dtype=args.dtype, device=args.device, seed=0)
    vc = model.config.vision_config
    rng = np.random.default_rng(0)
    console = Console()
    table = Table(title=f"MoonViT on {args.preset} ({args.dtype}, {args.device}): one image")
    for col in ("image", "patches", "tokens", "engine ms (fwd)", "learner ms (fwd+bwd)"):
        table.add_column(col, justify="right")
    for w, h in SIZES:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        media = preprocess_media([img], vc)
        media.pixel_values = media.pixel_values.to(args.device)

        def forward(media=media):
            with torch.no_grad():
                model.encode_media(media)

        def forward_backward(media=media):
            model.zero_grad(set_to_none=True)
            model.encode_media(media).float().square().mean().backward()

        table.add_row(f"{w} x {h}", str(media.pixel_values.shape[0]), str(media.tokens_per_item()[0]),
                      f"{timed(forward, args.repeat, args.device) * 1e3:.2f}",
                      f"{timed(forward_backward, args.repeat, args.device) * 1e3:.2f}")
    console.print(table)

    traj = screen_episode(10)
    assert traj.error is None and len(traj.images) == 10, traj.error
    images = [from_png(b) for b in traj.images]
    ids = torch.tensor([traj.token_ids], device=args.device)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(ids, images=images, cache=cache)
    fixed, per_token = cache_bytes(cache)
    image_tokens = sum(preprocess_media([im], vc).tokens_per_item()[0] for im in images)
    total = fixed + per_token * len(traj.token_ids)
    png = sum(len(b) for b in traj.images)
    console.print(f"an episode at 10 images (ScreenRead, {len(traj.token_ids)} tokens of which {image_tokens} image "
                  f"tokens): decoding state {total / 2**10:.1f} KiB = {fixed / 2**10:.1f} KiB fixed (KDA) + "
                  f"{per_token} B/token (MLA latents) x {len(traj.token_ids)} tokens; image tokens "
                  f"{per_token * image_tokens / 2**10:.1f} KiB of it; PNG bytes {png / 2**10:.1f} KiB")
    big = preprocess_media([Image.new("RGB", (1024, 768))], vc).tokens_per_item()[0]
    console.print(f"at 10 images of 1024 x 768 ({big} tokens each) the image tokens alone would hold "
                  f"{per_token * big * 10 / 2**20:.2f} MiB of MLA latents per episode")


if __name__ == "__main__":
    main()
