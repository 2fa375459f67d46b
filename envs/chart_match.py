"""`k3rl/ChartMatch-v0`: vision in the loop — reproduce a target chart from its picture.

The opening user message shows the target chart (a PNG). The agent writes matplotlib code
(or SVG) and calls `render(code=..., language=...)`; the code runs in a sandbox and the
screenshot comes back as an image in the tool result; the agent looks and iterates. A reply
without a tool call ends the episode; the reward is `image_similarity(last render, target)`
(k3rl.envs.similarity: 1 - normalised mean absolute difference of 64x48 grayscale
thumbnails, 1 = identical, 0 = no better than a blank canvas). No render scores 0.

Task set: `NUM_TASKS` chart specs generated from their index (kind, values, colour); the
target PNGs were rendered by the sandbox renderer and ship in `chart_match_targets.json`
(rebuild with `python -m k3rl.envs.chart_match`), so `reset` needs no sandbox. A target
missing from the file is rendered on first use and kept in memory.
`reset(options={"task_index": 7})` picks a task.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from k3rl.chat import Message
from k3rl.envs.base import ToolEnv
from k3rl.envs.similarity import image_similarity
from k3rl.envs.tools import ToolError, ToolResult, tool
from k3rl.sandboxes import RenderError, image_version, open_sandbox, render_matplotlib, render_svg

WIDTH, HEIGHT, DPI = 256, 192, 64
NUM_TASKS = 32
KINDS = ("bar", "barh", "line", "scatter", "step")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "black")
TARGETS_FILE = Path(__file__).with_name("chart_match_targets.json")


@dataclass(frozen=True)
class ChartTask:
    index: int
    kind: str
    values: tuple[int, ...]
    color: str

    @property
    def id(self) -> str:
        return f"chart{self.index:02d}"

    @property
    def code(self) -> str:
        """The matplotlib program that draws the target (what the oracle renders)."""
        xs = list(range(len(self.values)))
        ys = list(self.values)
        draw = {
            "bar": f"ax.bar({xs}, {ys}, color={self.color!r})",
            "barh": f"ax.barh({xs}, {ys}, color={self.color!r})",
            "line": f"ax.plot({xs}, {ys}, color={self.color!r}, linewidth=3)",
            "scatter": f"ax.scatter({xs}, {ys}, color={self.color!r}, s=80)",
            "step": f"ax.step({xs}, {ys}, color={self.color!r}, linewidth=3)",
        }[self.kind]
        limit = "ax.set_xlim(0, 10)" if self.kind == "barh" else "ax.set_ylim(0, 10)"
        return f"fig, ax = plt.subplots()\n{draw}\n{limit}\n"


def chart_task(index: int) -> ChartTask:
    """Task `index` of the shipped set (a pure function of the index)."""
    if not 0 <= index < NUM_TASKS:
        raise ValueError(f"ChartMatch task index must be in [0, {NUM_TASKS}), got {index}")
    r = np.random.default_rng([0xC4A7, index])
    kind = KINDS[index % len(KINDS)]
    values = tuple(int(v) for v in r.integers(1, 10, size=int(r.integers(3, 7))))
    return ChartTask(index, kind, values, COLORS[int(r.integers(len(COLORS)))])


def load_targets(path: Path = TARGETS_FILE) -> dict[int, bytes]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {int(k): base64.b64decode(v) for k, v in data["targets"].items()}


_SHIPPED: dict[int, bytes] | None = None
_RENDERED: dict[int, bytes] = {}


class ChartMatchEnv(ToolEnv):
    """Redraw the chart in the picture; `render` shows your attempt. Reward = similarity of the last render."""

    default_max_turns = 6
    uses_sandbox = True

    def __init__(self, render_timeout_s: float = 60.0, **kwargs: Any) -> None:
        self.render_timeout_s = render_timeout_s
        self.last_render: bytes | None = None
        super().__init__(**kwargs)

    def generate_task(self, rng, options: dict[str, Any]) -> ChartTask:
        index = options.get("task_index")
        self.last_render = None
        return chart_task(int(rng.integers(NUM_TASKS)) if index is None else int(index))

    def target(self, task: ChartTask | None = None) -> bytes:
        """The target PNG of `task` (default: the current one)."""
        global _SHIPPED
        task = task or self.task
        if _SHIPPED is None:
            _SHIPPED = load_targets()
        if task.index in _SHIPPED:
            return _SHIPPED[task.index]
        if task.index not in _RENDERED:
            _RENDERED[task.index] = render_matplotlib(self.sandbox, task.code, width=WIDTH, height=HEIGHT, dpi=DPI,
                                                      timeout=self.render_timeout_s)
        return _RENDERED[task.index]

    def opening_messages(self, task: ChartTask) -> list[Message]:
        return [Message(role="user", images=[self.target(task)], content=(
            f"Reproduce this {WIDTH}x{HEIGHT} chart. Write matplotlib code (`plt` is imported; draw on a figure) "
            "or an SVG document and call render to see your result. Reply without a tool call when it matches."))]

    @tool(name="render")
    def render_code(self, code: str, language: Literal["matplotlib", "svg"] = "matplotlib") -> ToolResult:
        """Render matplotlib code or an SVG document in a sandbox and return the picture.

        Args:
            code: Python code that draws with matplotlib (plt is imported), or an SVG document.
            language: "matplotlib" or "svg".
        """
        timeout = max(1.0, min(self.render_timeout_s, self.remaining_s()))
        try:
            if language == "svg":
                png = render_svg(self.sandbox, code, width=WIDTH, height=HEIGHT, timeout=timeout)
            else:
                png = render_matplotlib(self.sandbox, code, width=WIDTH, height=HEIGHT, dpi=DPI, timeout=timeout)
        except RenderError as e:
            raise ToolError(str(e)) from None
        self.last_render = png
        return ToolResult(f"rendered {language} ({WIDTH}x{HEIGHT}):", images=[png])

    def score(self, final_text: str) -> float:
        if self.last_render is None:
            return 0.0
        return image_similarity(self.last_render, self.target())

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Render the target's own program once, then stop."""
        messages = self._messages(history)
        last = messages[-1] if messages else None
        if last is not None and last.role == "tool" and last.tool_name == "render" and last.images:
            return self.say("The render matches the target.")
        return self.say("Drawing the chart.", [{"name": "render", "arguments": {"code": self.task.code}}])


def build_targets(backend: str = "auto", path: Path = TARGETS_FILE) -> Path:
    """Render every task's target in a sandbox and write them to `path` (run after a sandbox image change)."""
    targets = {}
    with open_sandbox(backend=backend) as sb:
        for i in range(NUM_TASKS):
            png = render_matplotlib(sb, chart_task(i).code, width=WIDTH, height=HEIGHT, dpi=DPI)
            targets[str(i)] = base64.b64encode(png).decode("ascii")
    doc = {"sandbox_image": image_version(), "width": WIDTH, "height": HEIGHT, "dpi": DPI, "targets": targets}
    path.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
    return path


if __name__ == "__main__":  # python -m k3rl.envs.chart_match [backend]
    import sys

    print(build_targets(*(sys.argv[1:2] or ["auto"])))
