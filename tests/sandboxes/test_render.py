"""Rendering for vision-in-the-loop: real matplotlib and rsvg-convert inside the sandbox."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from k3rl.sandboxes import RenderError, render_matplotlib, render_svg
from k3rl.sandboxes.render import png_size, to_pil

RED_SQUARE = """
import matplotlib.pyplot as plt
fig = plt.figure()
ax = fig.add_axes([0, 0, 1, 1])
ax.set_axis_off()
ax.add_patch(plt.Rectangle((0, 0), 1, 1, color="red"))
"""

SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="50" viewBox="0 0 100 50">'
    '<rect x="0" y="0" width="50" height="50" fill="#0000ff"/>'
    '<rect x="50" y="0" width="50" height="50" fill="#00ff00"/></svg>'
)


def test_matplotlib_figure_comes_back_as_png_of_the_asked_size(sb):
    png = render_matplotlib(sb, RED_SQUARE, width=320, height=200)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (320, 200) == png_size(png)
    assert image.getpixel((160, 100)) == (255, 0, 0)  # what the code drew, not a blank canvas
    # the default "current figure" path works too, and the render dir is cleaned up
    line = render_matplotlib(
        sb, "import matplotlib.pyplot as plt\nplt.plot([0, 1], [0, 1])", width=64, height=48
    )
    assert to_pil(line).size == (64, 48)
    assert sb.exec("ls -A .k3rl-render").stdout == ""


def test_bad_matplotlib_code_raises_with_the_sandbox_traceback(sb):
    with pytest.raises(RenderError, match="ZeroDivisionError"):
        render_matplotlib(sb, "import matplotlib.pyplot as plt\nplt.plot([1 / 0])")
    with pytest.raises(RenderError, match="drew nothing"):
        render_matplotlib(sb, "x = 1")
    with pytest.raises(RenderError, match="width"):
        render_matplotlib(sb, RED_SQUARE, width=10_000)
    with pytest.raises(RenderError, match="timed out"):
        render_matplotlib(sb, "import time\ntime.sleep(30)", timeout=2)


def test_svg_is_rasterised_in_the_sandbox(sb):
    png = render_svg(sb, SVG, width=200)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (200, 100)  # aspect ratio kept
    assert image.getpixel((50, 50)) == (0, 0, 255)
    assert image.getpixel((150, 50)) == (0, 255, 0)
    with pytest.raises(RenderError, match="SVG rendering failed"):
        render_svg(sb, "<svg><this is not xml")
    with pytest.raises(RenderError, match="non-empty"):
        render_svg(sb, "   ")


def test_oversized_result_is_refused(sb):
    with pytest.raises(RenderError, match="over the limit"):
        render_matplotlib(sb, RED_SQUARE, width=400, height=400, max_bytes=100)
