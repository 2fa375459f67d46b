"""ChartMatch's image similarity: 1 for identical, 0 for blank or worse, monotone in between."""

from PIL import Image, ImageDraw

from k3rl.envs.chart_match import load_targets
from k3rl.envs.similarity import image_similarity
from k3rl.images import to_png


def chart(bars, size=(256, 192), color=(31, 119, 180), mode="RGB"):
    img = Image.new(mode, size, "white" if mode == "RGB" else (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    k = size[0] / 256  # draw in coordinates of a 256x192 canvas
    for i, h in enumerate(bars):
        d.rectangle([k * (30 + 40 * i), k * (170 - 15 * h), k * (60 + 40 * i), k * 170], fill=color)
    return to_png(img)


def test_identical_blank_and_between():
    target = chart([3, 7, 2, 5])
    assert image_similarity(target, target) == 1.0
    assert image_similarity(chart([]), target) == 0.0
    one_off = image_similarity(chart([3, 7, 2, 4]), target)
    two_off = image_similarity(chart([3, 5, 2, 2]), target)
    all_off = image_similarity(chart([8, 1, 9, 1]), target)
    assert 1.0 > one_off > two_off > all_off >= 0.0


def test_size_and_transparency_do_not_matter():
    target = chart([3, 7, 2, 5])
    assert image_similarity(chart([3, 7, 2, 5], size=(512, 384)), target) > 0.9
    # an RGBA render with a transparent background is composited onto white first
    assert image_similarity(chart([3, 7, 2, 5], mode="RGBA", color=(31, 119, 180, 255)), target) == 1.0


def test_shipped_targets_are_distinct():
    targets = load_targets()
    sims = [image_similarity(targets[i], targets[i + 1]) for i in range(len(targets) - 1)]
    assert max(sims) < 0.95
