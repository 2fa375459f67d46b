"""`k3rl/McpFiles-v0`: find a setting or a colour in the sandbox's files through an MCP server.

The tools are not Python methods of the env: they come from an MCP server that runs inside
the episode's sandbox (`mcp_files_server.py`, started by `McpToolEnv`): `list_files`,
`read_file` and `view_image` (which returns image content: vision in the loop).

Two task families, drawn from the seed:

* `setting`: a few `.ini` files in a few folders; one of them sets the asked key. Answer its value.
* `colour`:  `images/` holds swatches; say the colour of the named one (only the image tells).

Reward 1 when the final answer names the right value (a whole word, case-insensitive), else 0.
The oracle reads the right file (or views the right image) once, then answers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from k3rl.chat import Message
from k3rl.envs.mcp_tools import McpServer, McpToolEnv
from k3rl.images import to_png

SERVER = McpServer(command=("python3", "-I", "/work/.mcp/files_server.py", "/work"),
                   files={".mcp/files_server.py": Path(__file__).with_name("mcp_files_server.py").read_bytes()},
                   tools=("list_files", "read_file", "view_image"))
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "purple": (130, 50, 170), "orange": (245, 140, 20)}
FOLDERS = ("app", "db", "cache", "net")
KEYS = ("timeout", "owner", "region", "codename", "backend", "channel", "flavour", "mirror")
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper",
         "kestrel", "lagoon", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "sierra", "tundra")


@dataclass(frozen=True)
class FilesTask:
    family: str
    question: str
    answer: str
    path: str  # the file that holds the answer
    files: dict[str, bytes] = field(default_factory=dict, compare=False)

    @property
    def id(self) -> str:
        return f"{self.family}:{self.path}:{self.answer}"


def _setting_task(rng) -> FilesTask:
    keys = [KEYS[i] for i in rng.permutation(len(KEYS))]
    asked, files = keys[0], {}
    folders = [FOLDERS[i] for i in rng.permutation(len(FOLDERS))[:3]]
    paths = [f"{folder}/{name}.ini" for folder in folders for name in ("main", "extra")]
    target = paths[int(rng.integers(len(paths)))]
    answer = WORDS[int(rng.integers(len(WORDS)))]
    others = iter(keys[1:] * 3)
    for path in paths:
        lines = [f"{next(others)} = {WORDS[int(rng.integers(len(WORDS)))]}" for _ in range(2)]
        if path == target:
            lines.insert(int(rng.integers(3)), f"{asked} = {answer}")
        files[path] = ("[section]\n" + "\n".join(lines) + "\n").encode()
    question = (f"One of the .ini files under the work dir sets `{asked}`. What is its value? "
                "Answer with the value only.")
    return FilesTask("setting", question, answer, target, files)


def _colour_task(rng) -> FilesTask:

    names = list(COLOURS)
    picks = [names[i] for i in rng.permutation(len(names))[:3]]
    files = {f"images/swatch{i}.png": to_png(Image.new("RGB", (32, 32), COLOURS[c])) for i, c in enumerate(picks)}
    which = int(rng.integers(len(picks)))
    question = (f"What colour is the image images/swatch{which}.png? Answer with one word: "
                f"{', '.join(names)}.")
    return FilesTask("colour", question, picks[which], f"images/swatch{which}.png", files)


FAMILIES = {"setting": _setting_task, "colour": _colour_task}


class McpFilesEnv(McpToolEnv):
    """Answer a question about the sandbox's files, read through an MCP server. Reward 1 for the right value."""

    default_max_turns = 8
    mcp_server = SERVER
    system_prompt = ("You can look at the files of the work dir with the tools list_files, read_file and "
                     "view_image. Reply with the answer, without a tool call, when you know it.")

    def __init__(self, families: Sequence[str] | None = None, **kwargs: Any) -> None:
        names = list(families or FAMILIES)
        unknown = [f for f in names if f not in FAMILIES]
        if unknown or not names:
            raise ValueError(f"unknown task families {unknown}; choose from {sorted(FAMILIES)}")
        self.families = names
        super().__init__(**kwargs)

    def generate_task(self, rng, options: dict[str, Any]) -> FilesTask:
        family = options.get("family") or self.families[int(rng.integers(len(self.families)))]
        if family not in FAMILIES:
            raise ValueError(f"options['family']={family!r} is not one of {sorted(FAMILIES)}")
        return FAMILIES[family](rng)

    def opening_messages(self, task: FilesTask) -> list[Message]:
        return [Message(role="user", content=task.question)]

    def setup_sandbox(self, sandbox: Any) -> None:
        for path, data in self.task.files.items():
            sandbox.write_file(path, data)

    def score(self, final_text: str) -> float:
        return 1.0 if re.search(rf"\b{re.escape(self.task.answer)}\b", final_text, re.I) else 0.0

    def oracle(self, history: Sequence[Message | dict] | None = None) -> str:
        """Read the file that holds the answer (or view the swatch) once, then answer."""
        messages = self._messages(history)
        if any(m.role == "tool" and not m.content.startswith("Error") for m in messages):
            return self.say(f"{self.task.answer}")
        tool = "view_image" if self.task.family == "colour" else "read_file"
        return self.say("Let me look.", [{"name": tool, "arguments": {"path": self.task.path}}])
