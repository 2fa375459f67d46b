"""`k3rl/ScreenRead-v0`: vision in the loop — open a panel of an app and read its number off the screenshot.

    user:      panels a c; read c
    assistant: (call) show(panel="c")
    tool:      [screenshot]                  <- the value exists only as pixels
    assistant: 7                             -> reward 1, episode ends

The smallest computer-use task: an action (`show`) changes what is on a screen, and the
screenshot that comes back is the only place the answer is. The screenshot is `cells` glyph
cells of 28 x 28 pixels (one image token each with MoonViT-V2's 14-pixel patches merged 2 x 2):
the panel's letter, then its value, drawn with a 5 x 7 bitmap font at 3x in colours and at an
offset drawn from the task's seed (so reading it is a vision problem, not a lookup of fixed
pixels). The tool's text says nothing of the value.

Rewards (`partial_credit`, the default, for small policies): 0.25 for showing a panel that exists
and 0.25 for the requested one (paid in that turn with `turn_rewards`), 0.5 for the exact value
(the answer's turn); success is the full 1. Without partial credit: 1 for the exact value.

`blank_images=True` replaces every screenshot by an empty screen of the same size (the same
tokens): the ablation that shows the images are necessary — a policy that reads them drops to
chance (1 / 10 for a digit). `oracle_mistakes=q` makes the oracle a careless demonstrator: with
probability q (once per episode) it shows another panel and answers what that one says.
"""

from __future__ import annotations

import io
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.tools import ToolError, ToolResult, tool

CELL = 28  # pixels per glyph cell: 2 x 2 patches of 14, merged into one image token
SCALE = 3  # a 5 x 7 glyph drawn at 15 x 21 pixels
# 5 x 7 bitmaps: one string of 5 bits per row, top to bottom
GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11110", "00001", "00001", "01110", "00001", "00001", "11110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
    "a": ("00000", "00000", "01110", "00001", "01111", "10001", "01111"),
    "b": ("10000", "10000", "10110", "11001", "10001", "10001", "11110"),
    "c": ("00000", "00000", "01110", "10000", "10000", "10001", "01110"),
    "d": ("00001", "00001", "01101", "10011", "10001", "10001", "01111"),
    "e": ("00000", "00000", "01110", "10001", "11111", "10000", "01110"),
    "f": ("00110", "01001", "01000", "11100", "01000", "01000", "01000"),
    "g": ("00000", "01111", "10001", "10001", "01111", "00001", "01110"),
    "h": ("10000", "10000", "10110", "11001", "10001", "10001", "10001"),
}
LETTERS = "abcdefgh"
# (background, foreground) pairs of clearly different luminance
PALETTE = (((255, 255, 255), (20, 20, 20)), ((250, 240, 200), (40, 40, 160)), ((30, 30, 40), (240, 240, 120)),
           ((220, 235, 255), (150, 20, 20)), ((20, 60, 30), (250, 250, 250)), ((255, 225, 235), (0, 90, 70)))


def draw_cells(text: str, colors: tuple[tuple[int, int, int], tuple[int, int, int]],
               offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """An RGB image [CELL, CELL * len(text), 3]: each character's glyph in its own cell, at its offset
    (dx, dy) from the cell's centre; a space is an empty cell."""
    bg, fg = colors
    img = np.empty((CELL, CELL * len(text), 3), np.uint8)
    img[:] = bg
    h, w = 7 * SCALE, 5 * SCALE
    for i, (ch, (dx, dy)) in enumerate(zip(text, offsets, strict=True)):
        if ch == " ":
            continue
        bits = np.array([[c == "1" for c in row] for row in GLYPHS[ch]])
        mask = np.kron(bits, np.ones((SCALE, SCALE), bool))  # [21, 15]
        top, left = (CELL - h) // 2 + dy, i * CELL + (CELL - w) // 2 + dx
        img[top:top + h, left:left + w][mask] = fg
    return img


def png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class ScreenTask:
    panels: tuple[str, ...]
    values: tuple[str, ...]
    panel: str  # the one to read
    colors: tuple[int, ...]  # palette index per panel
    offsets: tuple[tuple[tuple[int, int], ...], ...]  # per panel: (dx, dy) per glyph cell

    @property
    def id(self) -> str:
        return f"{' '.join(self.panels)}|{self.panel}|{''.join(self.values)}|{''.join(map(str, self.colors))}"

    @property
    def value(self) -> str:
        return self.values[self.panels.index(self.panel)]


class ScreenReadEnv(ToolEnv):
    """Show the requested panel and answer the number its screenshot shows. Reward 1 for the exact number."""

    default_max_turns = 3
    declare_tools_by_default = False  # the prompt names the tool ("read c" -> show)

    def __init__(self, num_panels: int = 2, value_digits: int = 1, panel_letters: str = "abcd",
                 partial_credit: bool = True, turn_rewards: bool = True, blank_images: bool = False,
                 max_offset: int = 2, oracle_mistakes: float = 0.0, **kwargs: Any) -> None:
        if not panel_letters or set(panel_letters) - set(LETTERS) or len(set(panel_letters)) != len(panel_letters):
            raise ValueError(f"panel_letters must be distinct letters of {LETTERS!r}, got {panel_letters!r}")
        if not 1 <= num_panels <= len(panel_letters):
            raise ValueError(f"num_panels must be in 1..{len(panel_letters)} (one letter each), got {num_panels}")
        if not 1 <= value_digits <= 4:
            raise ValueError(f"value_digits must be in 1..4, got {value_digits}")
        if turn_rewards and not partial_credit:
            raise ValueError("turn_rewards pays the partial credit per turn; set partial_credit=True too")
        if not 0 <= max_offset <= (CELL - 7 * SCALE) // 2:
            raise ValueError(f"max_offset must be in 0..{(CELL - 7 * SCALE) // 2} pixels, got {max_offset}")
        if not 0.0 <= oracle_mistakes <= 1.0 or (oracle_mistakes > 0 and num_panels < 2):
            raise ValueError(f"oracle_mistakes is a probability in [0, 1] and needs num_panels >= 2, "
                             f"got {oracle_mistakes} with num_panels={num_panels}")
        self.num_panels, self.value_digits, self.panel_letters = num_panels, value_digits, panel_letters
        self.partial_credit, self.turn_rewards, self.blank_images = partial_credit, turn_rewards, blank_images
        self.max_offset, self.oracle_mistakes = max_offset, oracle_mistakes
        self._shown: list[str] = []
        self._paid = 0.0
        self._oracle_panel: str | None = None
        super().__init__(**kwargs)

    def generate_task(self, rng, options: dict[str, Any]) -> ScreenTask:
        panels = tuple(str(c) for c in rng.choice(list(self.panel_letters), size=self.num_panels, replace=False))
        lo = 10 ** (self.value_digits - 1) if self.value_digits > 1 else 0
        values = tuple(str(int(rng.integers(lo, 10 ** self.value_digits))) for _ in panels)
        colors = tuple(int(rng.integers(len(PALETTE))) for _ in panels)
        m = self.max_offset
        offsets = tuple(tuple((int(rng.integers(-m, m + 1)), int(rng.integers(-m, m + 1)))
                              for _ in range(1 + self.value_digits)) for _ in panels)
        return ScreenTask(panels, values, panels[int(rng.integers(len(panels)))], colors, offsets)

    def opening_messages(self, task: ScreenTask) -> list[Message]:
        return [Message(role="user", content=f"panels {' '.join(task.panels)}; read {task.panel}")]

    def screenshot(self, panel: str) -> bytes:
        """The screen with `panel` open: its letter, a gap-free row of its value's digits."""
        i = self.task.panels.index(panel)
        text = panel + self.task.values[i]
        if self.blank_images:
            text = " " * len(text)
        return png(draw_cells(text, PALETTE[self.task.colors[i]], self.task.offsets[i]))

    @tool
    def show(self, panel: str) -> ToolResult:
        """Open a panel of the app; returns a screenshot.

        Args:
            panel: the panel's letter.
        """
        self._shown.append(panel)
        if panel not in self.task.panels:
            raise ToolError(f"no panel {panel!r}; panels: {' '.join(self.task.panels)}")
        with self.timed("render"):
            shot = self.screenshot(panel)
        return ToolResult("screen:", images=[shot])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._shown, self._paid, self._oracle_panel = [], 0.0, None
        return super().reset(seed=seed, options=options)

    def reward_parts(self, final_text: str | None = None) -> dict[str, float]:
        """The reward's parts so far (the final answer's when given)."""
        parts = {"valid_panel": 0.25 if any(p in self.task.panels for p in self._shown) else 0.0,
                 "requested_panel": 0.25 if self.task.panel in self._shown else 0.0}
        if final_text is not None:
            parts["value"] = 0.5 if final_text.strip() == self.task.value else 0.0
        return parts

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.turn_rewards:  # the panel's credit in the turn that earned it, once
            earned = sum(v for k, v in self.reward_parts().items() if k != "value") - self._paid
            self._paid += earned
            reward += earned
        return obs, reward, terminated, truncated, info

    def score(self, final_text: str) -> float:
        correct = final_text.strip() == self.task.value
        if not self.partial_credit:
            return float(correct)
        parts = self.reward_parts(final_text)
        return parts["value"] if self.turn_rewards else sum(parts.values())

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Show the requested panel, then answer its value (read from the task, not the pixels). With
        `oracle_mistakes` = q: with probability q it shows another panel and answers that one's value."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        if last is not None and last.role == "tool" and last.tool_name == "show" and last.images:
            return self.say(self.task.values[self.task.panels.index(self._oracle_panel or self.task.panel)])
        if self._oracle_panel is None:
            self._oracle_panel = self.task.panel
            if self.oracle_mistakes > 0 and self.np_random.random() < self.oracle_mistakes:
                others = [p for p in self.task.panels if p != self.task.panel]
                self._oracle_panel = others[int(self.np_random.integers(len(others)))]
        return self.say(tool_calls=[{"name": "show", "arguments": {"panel": self._oracle_panel}}])


assert set(LETTERS) | set(string.digits) == set(GLYPHS)
