"""Rendering for vision-in-the-loop: code that draws runs in the sandbox, PNG bytes come back.

    png = render_matplotlib(sb, "import matplotlib.pyplot as plt\\nplt.plot([1, 2, 3])", width=640, height=480)
    png = render_svg(sb, '<svg xmlns="http://www.w3.org/2000/svg" ...>...</svg>', width=256)

Untrusted drawing code never runs on the host: only the PNG crosses the boundary, and it is
checked (PNG signature, size in pixels and bytes) before it is returned. Bad code, a
figure that draws nothing, bad SVG or an oversized result raise `RenderError` with the
sandbox's own error message (the last lines of the traceback).
"""

from __future__ import annotations

import io
import struct
import uuid

from PIL import Image

from .base import Sandbox
from .types import SandboxError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_SIDE_PX = 4096
MAX_PNG_BYTES = 16 << 20
MAX_SOURCE_BYTES = 4 << 20


class RenderError(SandboxError, ValueError):
    """Rendering failed: bad drawing code / SVG, a timeout, or a result over the limits."""


# Runs inside the sandbox: exec the user's code, save the current (or `fig`) figure as PNG.
MATPLOTLIB_DRIVER = """
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
code_path, out_path, width, height, dpi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
namespace = {"__name__": "__main__", "plt": plt}
source = open(code_path, encoding="utf-8").read()
exec(compile(source, "<figure code>", "exec"), namespace)
fig = namespace.get("fig")
if not isinstance(fig, matplotlib.figure.Figure):
    fig = plt.gcf() if plt.get_fignums() else None
if fig is None or not (fig.get_axes() or fig.artists or fig.lines or fig.patches or fig.texts or fig.images):
    sys.exit("k3rl-render: the code drew nothing (no matplotlib figure with content)")
fig.set_size_inches(width / dpi, height / dpi)
fig.savefig(out_path, format="png", dpi=dpi)
"""


def _check_size(width: int | None, height: int | None) -> None:
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        if not isinstance(value, int) or not 1 <= value <= MAX_SIDE_PX:
            raise RenderError(f"{name} must be an int in [1, {MAX_SIDE_PX}] pixels, got {value!r}")


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; RenderError when `png` is not a PNG."""
    if len(png) < 24 or not png.startswith(PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise RenderError("the renderer did not produce a PNG")
    return struct.unpack(">II", png[16:24])


def _checked_png(png: bytes, max_bytes: int) -> bytes:
    if len(png) > max_bytes:
        raise RenderError(f"rendered PNG is {len(png)} bytes, over the limit of {max_bytes}")
    w, h = png_size(png)
    if w > MAX_SIDE_PX or h > MAX_SIDE_PX:
        raise RenderError(f"rendered PNG is {w}x{h} px, over the limit of {MAX_SIDE_PX} px per side")
    return png


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_render(sb: Sandbox, cmd: str, what: str, timeout: float) -> None:
    result = sb.exec(cmd, timeout=timeout)
    if result.timed_out:
        raise RenderError(f"{what} timed out after {timeout:.0f}s")
    if result.oom_killed:
        raise RenderError(f"{what} ran out of memory (sandbox limit {sb.limits.memory_mb} MB)")
    if result.exit_code != 0:
        message = _tail(result.stderr) or _tail(result.stdout) or f"exit code {result.exit_code}"
        raise RenderError(f"{what} failed:\n{message}")


def render_matplotlib(
    sandbox: Sandbox,
    code: str,
    *,
    width: int = 640,
    height: int = 480,
    dpi: int = 100,
    timeout: float = 60.0,
    max_bytes: int = MAX_PNG_BYTES,
) -> bytes:
    """Run matplotlib `code` in `sandbox`; return the figure (`fig` if defined, else the current one) as PNG."""
    _check_size(width, height)
    if not isinstance(code, str) or not code.strip():
        raise RenderError("matplotlib code must be a non-empty str")
    if len(code.encode()) > MAX_SOURCE_BYTES:
        raise RenderError(f"matplotlib code is over {MAX_SOURCE_BYTES} bytes")
    if not 10 <= dpi <= 600:
        raise RenderError(f"dpi must be in [10, 600], got {dpi}")
    job = f".k3rl-render/{uuid.uuid4().hex}"
    sandbox.write_file(f"{job}/figure.py", code)
    sandbox.write_file(f"{job}/driver.py", MATPLOTLIB_DRIVER)
    try:
        _run_render(
            sandbox,
            f"python3 {job}/driver.py {job}/figure.py {job}/out.png {width} {height} {dpi}",
            "matplotlib code",
            timeout,
        )
        return _checked_png(_read_limited(sandbox, f"{job}/out.png", max_bytes), max_bytes)
    finally:
        _cleanup(sandbox, job)


def render_svg(
    sandbox: Sandbox,
    svg: str | bytes,
    *,
    width: int | None = None,
    height: int | None = None,
    timeout: float = 30.0,
    max_bytes: int = MAX_PNG_BYTES,
) -> bytes:
    """Rasterise `svg` with rsvg-convert inside `sandbox`; width/height (px) scale it, keeping aspect."""
    _check_size(width, height)
    data = svg.encode() if isinstance(svg, str) else bytes(svg)
    if not data.strip():
        raise RenderError("svg must be non-empty")
    if len(data) > MAX_SOURCE_BYTES:
        raise RenderError(f"svg is {len(data)} bytes, over {MAX_SOURCE_BYTES}")
    job = f".k3rl-render/{uuid.uuid4().hex}"
    sandbox.write_file(f"{job}/in.svg", data)
    size = "".join(f" --{n} {v}" for n, v in (("width", width), ("height", height)) if v is not None)
    keep = " --keep-aspect-ratio" if (width is None) != (height is None) else ""
    try:
        _run_render(
            sandbox,
            f"command -v rsvg-convert >/dev/null || {{ echo 'rsvg-convert missing: the sandbox image needs "
            f"librsvg2-bin' >&2; exit 127; }}; rsvg-convert --format png{size}{keep} -o {job}/out.png {job}/in.svg",
            "SVG rendering",
            timeout,
        )
        return _checked_png(_read_limited(sandbox, f"{job}/out.png", max_bytes), max_bytes)
    finally:
        _cleanup(sandbox, job)


def _read_limited(sandbox: Sandbox, path: str, max_bytes: int) -> bytes:
    size = sandbox.exec(f"stat -c %s {path}", timeout=10)
    if size.exit_code != 0:
        raise RenderError(f"the renderer wrote no image ({_tail(size.stderr)})")
    if int(size.stdout.strip()) > max_bytes:
        raise RenderError(f"rendered PNG is {size.stdout.strip()} bytes, over the limit of {max_bytes}")
    return sandbox.read_file(path)


def _cleanup(sandbox: Sandbox, job: str) -> None:
    try:
        sandbox.exec(f"rm -rf {job}", timeout=10)
    except SandboxError:
        pass


def to_pil(png: bytes):
    """Decode PNG bytes into a PIL image (for envs that hand images to the model)."""
    image = Image.open(io.BytesIO(png))
    image.load()
    return image
