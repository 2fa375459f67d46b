"""One episode as a self-contained HTML page: every turn with its role, text, thinking, tool calls
and their arguments, tool results, images inline (base64 PNG), errors, token counts and, for
assistant turns, the policy versions that produced their tokens; an episode whose context was
compacted is shown segment by segment, the turns compaction made marked (carried, dropped,
summary request, summary). No scripts, no external files."""

from __future__ import annotations

import base64
import json
from html import escape

from k3rl.images import png_size
from k3rl.types import Trajectory, Turn

STYLE = """
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table.meta td{padding:.1rem .8rem .1rem 0;vertical-align:top}
.turn{border:1px solid #ccc;border-radius:6px;margin:1rem 0;padding:.5rem .8rem}
.turn h3{margin:.2rem 0 .5rem;font-size:1rem}
.system{background:#f4f4f4}.user{background:#eef5ff}.assistant{background:#f0fff0}.tool{background:#fff8e8}
pre{white-space:pre-wrap;word-break:break-word;background:#fff;border:1px solid #eee;padding:.4rem;margin:.3rem 0}
.info{color:#666;font-size:.85rem}.error{color:#b00;font-weight:bold}
figure{display:inline-block;margin:.3rem}figcaption{font-size:.8rem;color:#666}
img{max-width:100%;image-rendering:pixelated;border:1px solid #ddd}
.carried,.dropped{opacity:.6}h2.segment{border-top:3px double #888;padding-top:.5rem;font-size:1.1rem}
"""


def _pre(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def _image(png: bytes, label: str) -> str:
    w, h = png_size(png)
    scale = max(1, 128 // max(w, h))  # small observations are shown enlarged (pixelated), at least 128 px
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" width="{w * scale}" height="{h * scale}" '
            f'alt="{escape(label)}">'
            f"<figcaption>{escape(label)} ({w}x{h}, {len(png)} bytes)</figcaption></figure>")


def turn_token_info(traj: Trajectory, turn: Turn) -> dict:
    """Token count of a turn's span and, for the generated tokens in it, the policy versions
    that sampled them and their mean behaviour log-prob."""
    n_prompt = len(traj.prompt_ids)
    # span [start, end) indexes prompt+completion; the per-token arrays index the completion only
    lo, hi = max(turn.start - n_prompt, 0), max(turn.end - n_prompt, 0)
    mask = traj.loss_mask[lo:hi]
    versions = sorted({v for v, m in zip(traj.versions[lo:hi], mask, strict=True) if m})
    lps = [lp for lp, m in zip(traj.logprobs[lo:hi], mask, strict=True) if m]
    return {
        "tokens": turn.end - turn.start,
        "generated": sum(mask),
        "versions": versions,
        "mean_logprob": sum(lps) / len(lps) if lps else None,
    }


def _turn(traj: Trajectory, index: int, turn: Turn) -> str:
    info = turn_token_info(traj, turn)
    title = escape(turn.role)
    if turn.role == "tool" and turn.tool_name:
        title += f" &middot; result of <code>{escape(turn.tool_name)}</code>"
        if turn.tool_index is not None:
            title += f" (call {turn.tool_index})"
    if turn.compaction:
        title += f" &middot; <em>{escape(turn.compaction.replace('_', ' '))}</em>"
    kind = f" {turn.compaction}" if turn.compaction else ""
    parts = [f'<div class="turn {escape(turn.role)}{kind}" id="turn-{index}"><h3>#{index} {title}</h3>']
    details = [f"tokens {info['tokens']} [{turn.start}, {turn.end})"]
    if turn.role == "assistant":
        details.append(f"generated {info['generated']}")
        details.append("policy version " + (", ".join(map(str, info["versions"])) or "-"))
        if info["mean_logprob"] is not None:
            details.append(f"mean log-prob {info['mean_logprob']:.4f}")
    if turn.duration_s:
        details.append(f"{turn.duration_s:.3f}s")
    if turn.reward:
        details.append(f"reward {turn.reward:g}")
    parts.append(f'<div class="info">{escape(" · ".join(details))}</div>')
    if turn.thinking:
        parts.append(f"<details><summary>thinking</summary>{_pre(turn.thinking)}</details>")
    if turn.text:
        parts.append(_pre(turn.text))
    for call in turn.tool_calls:
        args = json.dumps(call.arguments, indent=2, ensure_ascii=False, sort_keys=True)
        parts.append(f"<div>tool call {call.index}: <code>{escape(call.name)}</code> "
                     f'<span class="info">id {escape(call.id)}</span>{_pre(args)}</div>')
    for k, png in enumerate(turn.images):
        parts.append(_image(png, f"image {index}_{k}"))
    if turn.error:
        parts.append(f'<div class="error">error: {escape(turn.error)}</div>')
    parts.append("</div>")
    return "\n".join(parts)


def render_episode_html(traj: Trajectory, title: str | None = None) -> str:
    """The whole episode as one HTML document (a str)."""
    meta = traj.metadata
    rows = [
        ("episode", traj.id),
        ("environment", traj.env_id),
        ("seed", traj.seed),
        ("task", traj.task_id or "-"),
        ("group", traj.group_id or "-"),
        ("training step", meta.get("step", "-")),
        ("policy version", meta.get("policy_version", "-")),
        ("reward", f"{traj.reward:g}"),
        ("ended", "terminated" if traj.terminated else "truncated" if traj.truncated else "unfinished"),
        ("assistant turns", traj.num_turns),
        ("tokens", f"{len(traj.prompt_ids)} prompt + {len(traj.completion_ids)} completion "
                   f"({traj.num_generated} generated)"),
        ("policy versions", ", ".join(map(str, sorted({v for v in traj.versions if v >= 0}))) or "-"),
        ("context segments", len(traj.segment_bounds)),
    ]
    rows += [(f"time {k}", f"{v:.3f}s") for k, v in sorted(traj.timings.items())]
    rows += [(f"meta {k}", json.dumps(v, ensure_ascii=False)) for k, v in sorted(meta.items())
             if k not in ("step", "policy_version")]
    head = title or f"episode {traj.id}"
    body = [f"<h1>{escape(head)}</h1>", '<table class="meta">']
    body += [f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows]
    body.append("</table>")
    if traj.error:
        body.append(f'<p class="error">episode error: {escape(traj.error)}</p>')
    bounds = traj.segment_bounds
    for i, t in enumerate(traj.turns):
        if len(bounds) > 1 and (i == 0 or t.segment != traj.turns[i - 1].segment):
            lo, hi = bounds[t.segment]
            note = "" if t.segment == 0 else " (a new context: compaction, rollout.context)"
            body.append(f'<h2 class="segment" id="segment-{t.segment}">segment {t.segment}: tokens [{lo}, {hi})'
                        f"{escape(note)}</h2>")
        body.append(_turn(traj, i, t))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{escape(head)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
