"""One episode as a self-contained HTML page (no scripts, no external files).

What the page shows, top to bottom:
  * the outcome: reward, how the episode ended, its error, and what the reward is made of (the env's
    `reward_parts`, per turn);
  * its GRPO group (with a `StepView`): every sample of the prompt with its reward and the advantage
    the trainer gave each turn, this one marked, the group's baseline;
  * the prompt as the model saw it, collapsed: the tool declarations and the whole rendered opening
    (with a tokenizer to decode the ids);
  * every turn: role, text, thinking, tool calls and their arguments, tool results, images inline
    (base64 PNG), errors, token counts, policy versions; an assistant turn's generated tokens as the
    model wrote them, beside what the episode loop parsed from them, each token's log-prob on hover
    and shaded by its probability; system messages collapsed. An episode whose context was compacted
    is shown segment by segment, the turns compaction made marked (carried, dropped, summary request,
    summary);
  * with a `Nav`: a list of the step's other episodes, linked, this one marked.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from html import escape
from typing import Any

from k3rl.images import png_size
from k3rl.types import Trajectory, Turn

STYLE = """
body{font-family:system-ui,sans-serif;margin:0;color:#222;display:flex;align-items:flex-start}
main{max-width:64rem;margin:1.5rem auto;padding:0 1rem;flex:1;min-width:0}
nav{width:17rem;flex:none;position:sticky;top:0;height:100vh;box-sizing:border-box;overflow:auto;font-size:.82rem;
  background:#f6f6f6;border-right:1px solid #ddd;padding:.6rem}
nav a{text-decoration:none;color:#124}nav li.current{font-weight:bold;background:#fff3b0}
nav ul{list-style:none;padding-left:.4rem;margin:.2rem 0}nav h4{margin:.6rem 0 .2rem}
table.meta td,table.grid td,table.grid th{padding:.1rem .7rem .1rem 0;vertical-align:top;text-align:left}
table.grid{border-collapse:collapse}table.grid th{border-bottom:1px solid #bbb}
table.grid tr.current{background:#fff3b0;font-weight:bold}td.num,th.num{text-align:right}
.turn{border:1px solid #ccc;border-radius:6px;margin:1rem 0;padding:.5rem .8rem}
.turn h3{margin:.2rem 0 .5rem;font-size:1rem}
.system{background:#f4f4f4}.user{background:#eef5ff}.assistant{background:#f0fff0}.tool{background:#fff8e8}
pre{white-space:pre-wrap;word-break:break-word;background:#fff;border:1px solid #eee;padding:.4rem;margin:.3rem 0}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:.6rem}.lbl{font-size:.8rem;color:#555}
.info{color:#666;font-size:.85rem}.error{color:#b00;font-weight:bold}
.reward{font-size:1.4rem;font-weight:bold}.good{color:#070}.bad{color:#b00}
figure{display:inline-block;margin:.3rem}figcaption{font-size:.8rem;color:#666}
img{max-width:100%;image-rendering:pixelated;border:1px solid #ddd}
.carried,.dropped{opacity:.6}h2.segment{border-top:3px double #888;padding-top:.5rem;font-size:1.1rem}
.tok{border-radius:2px}.tok:hover{outline:1px solid #333}
.sp{color:#888}.p1{background:#fff2b3}.p2{background:#ffd699}.p3{background:#ffb3a6}.p4{background:#ff8080}
"""
# a generated token's shade by its probability p = exp(log-prob): none above 0.9, then darker
SHADES = ((0.9, ""), (0.5, "p1"), (0.2, "p2"), (0.05, "p3"), (0.0, "p4"))


@dataclass
class NavEntry:
    id: str
    reward: float
    section: str  # the heading it is listed under (e.g. "group g0000232")
    href: str | None  # None: no page written for it


@dataclass
class Nav:
    title: str
    entries: list[NavEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. what else the step holds, and how to see it

    def href(self, episode_id: str) -> str | None:
        return next((e.href for e in self.entries if e.id == episode_id), None)


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


def token_pieces(tokenizer: Any, ids: list[int]) -> list[tuple[str, list[int]]]:
    """`ids` cut into pieces of text, one token each where it decodes on its own; the tokens of a
    character split across tokens (a byte tokenizer's UTF-8) stay together."""
    out, pending = [], []
    for i in ids:
        pending.append(i)
        text = tokenizer.decode(pending)
        if text.endswith("\ufffd") and len(pending) < 4:
            continue
        out.append((text, pending))
        pending = []
    if pending:
        out.append((tokenizer.decode(pending), pending))
    return out


def _generated_tokens(traj: Trajectory, turn: Turn, tokenizer: Any) -> str:
    """The turn's sampled tokens as spans: text, and on hover id, log-prob, probability, policy version."""
    P = len(traj.prompt_ids)
    lo, hi = max(turn.start - P, 0), max(turn.end - P, 0)
    at = [k for k in range(lo, hi) if traj.loss_mask[k]]
    spans, k = [], 0
    for text, ids in token_pieces(tokenizer, [traj.completion_ids[j] for j in at]):
        idx = at[k:k + len(ids)]
        k += len(ids)
        lps = [traj.logprobs[j] for j in idx]
        p = math.exp(min(lps))
        shade = next(name for bound, name in SHADES if p >= bound)
        if len(ids) == 1 and tokenizer.is_special(ids[0]):
            shade += " sp"
        tip = "; ".join(f"id {traj.completion_ids[j]}: log-prob {traj.logprobs[j]:.4f} (p {math.exp(traj.logprobs[j]):.3f}),"
                        f" policy v{traj.versions[j]}" for j in idx)
        spans.append(f'<span class="tok {shade}" title="{escape(tip)}">{escape(text)}</span>')
    return "".join(spans)


def advantage_text(values: list[float] | None) -> str:
    """An episode's advantages: one number when every turn has the same (an episode method), else per turn."""
    if values is None:
        return "-"
    if len(set(values)) == 1:
        return f"{values[0]:+.3f}"
    return " / ".join(f"{v:+.3f}" for v in values)


def _turn(traj: Trajectory, index: int, turn: Turn, tokenizer: Any, advantage: float | None) -> str:
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
    if advantage is not None:
        details.append(f"advantage {advantage:+.3f}")
    parts.append(f'<div class="info">{escape(" · ".join(details))}</div>')
    parsed = []
    if turn.thinking:
        parsed.append(f"<details><summary>thinking</summary>{_pre(turn.thinking)}</details>")
    if turn.text:
        parsed.append(_pre(turn.text))
    for call in turn.tool_calls:
        args = json.dumps(call.arguments, indent=2, ensure_ascii=False, sort_keys=True)
        parsed.append(f"<div>tool call {call.index}: <code>{escape(call.name)}</code> "
                      f'<span class="info">id {escape(call.id)}</span>{_pre(args)}</div>')
    if turn.role == "assistant" and tokenizer is not None and info["generated"]:
        raw = _generated_tokens(traj, turn, tokenizer)
        parts.append(f'<div class="cols"><div><div class="lbl">generated: {info["generated"]} tokens as sampled '
                     f'(hover a token for its log-prob; shaded by probability)</div><pre class="raw">{raw}</pre></div>'
                     f'<div><div class="lbl">parsed by the episode loop</div>{"".join(parsed) or "<pre></pre>"}'
                     f"</div></div>")
    elif turn.role == "system":
        parts.append(f"<details><summary>the system prompt ({len(turn.text)} characters)</summary>"
                     f"{''.join(parsed)}</details>")
    else:
        parts += parsed
    for k, png in enumerate(turn.images):
        parts.append(_image(png, f"image {index}_{k}"))
    if turn.error:
        parts.append(f'<div class="error">error: {escape(turn.error)}</div>')
    parts.append("</div>")
    return "\n".join(parts)


def _outcome(traj: Trajectory, view: Any) -> list[str]:
    ended = "terminated" if traj.terminated else "truncated" if traj.truncated else "unfinished"
    if traj.truncated and traj.metadata.get("truncated_by"):
        ended += f" ({traj.metadata['truncated_by']})"
    good = "good" if traj.reward >= 1.0 - 1e-6 else "bad" if traj.reward <= 0 else ""
    status = traj.metadata.get("status")
    out = ['<h2>Outcome</h2>', f'<p><span class="reward {good}">reward {traj.reward:g}</span> &middot; {escape(ended)}'
           + (f" &middot; {escape(status)}" if status else "") + "</p>"]
    if traj.error:
        out.append(f'<p class="error">episode error: {escape(traj.error)}</p>')
    parts = reward_parts(traj)
    if parts:
        rows = "".join(f'<tr><td><a href="#turn-{i}">#{i}</a></td><td>{escape(name)}</td><td class="num">{v:g}</td></tr>'
                       for i, name, v in parts)
        out.append('<table class="grid" id="reward-parts"><tr><th>turn</th><th>part (the env\'s)</th>'
                   f'<th class="num">value</th></tr>{rows}<tr><td></td><td>sum</td>'
                   f'<td class="num">{sum(v for _, _, v in parts):g}</td></tr></table>')
    else:
        out.append('<p class="info">the environment reported no reward parts (info["reward_parts"])</p>')
    note = reward_note(traj)
    if note:
        out.append(f'<p class="info">{escape(note)}</p>')
    return out


def _group(view: Any, nav: Nav | None) -> list[str]:
    if view is None or len(view.group) < 2 and view.method is None:
        return []
    head = f"<h2>Its group: {len(view.group)} samples of the same prompt</h2>"
    if view.method:
        base = view.baseline
        head += (f'<p class="info">advantage: learner.advantage {escape(view.method)} over the group\'s trained members'
                 + (f", baseline (mean reward) {base:.3f}" if base is not None else "")
                 + "; per turn, one value a turn (first / second / ...). Recomputed from the stored episodes with the "
                   "trainer's own function (no distillation term)</p>")
    else:
        head += '<p class="info">this episode was not trained: no advantage</p>'
    rows = []
    for m in view.group:
        href = nav.href(m.id) if nav is not None and m.id != view.episode.id else None
        name = f'<a href="{escape(href)}">{escape(m.id)}</a>' if href else escape(m.id)
        current = ' class="current"' if m.id == view.episode.id else ""
        rows.append(f"<tr{current}><td>{name}</td><td class=\"num\">{m.reward:g}</td>"
                    f"<td class=\"num\">{escape(advantage_text(m.advantages))}</td><td>{escape(m.status)}</td>"
                    f"<td class=\"num\">{m.turns}</td><td class=\"num\">{m.generated}</td>"
                    f"<td>{escape((m.error or '')[:80])}</td></tr>")
    return [head, '<table class="grid" id="group"><tr><th>episode</th><th class="num">reward</th>'
                  '<th class="num">advantage</th><th>status</th><th class="num">turns</th>'
                  f'<th class="num">generated</th><th>error</th></tr>{"".join(rows)}</table>']


def _prompt(traj: Trajectory, tokenizer: Any) -> list[str]:
    if tokenizer is None or not traj.prompt_ids:
        return []
    first = traj.turns[0].start if traj.turns else len(traj.prompt_ids)
    preamble = traj.prompt_ids[:first]
    declared = (f"<details><summary>before the first message: {len(preamble)} tokens (the tool declarations"
                f"{'' if preamble else ': none declared, the task names its tools'})</summary>"
                f"{_pre(tokenizer.decode(preamble))}</details>") if preamble else \
        '<p class="info">no tool declarations in the prompt (the task names its tools)</p>'
    return ["<h2>The prompt as the model saw it</h2>", declared,
            f"<details><summary>the rendered prompt: {len(traj.prompt_ids)} tokens (system prompt, tools, task, "
            f"generation prefix)</summary>{_pre(tokenizer.decode(traj.prompt_ids))}</details>"]


def _nav(nav: Nav, current: str) -> str:
    out = [f"<nav><h3>{escape(nav.title)}</h3>"]
    out += [f'<p class="info">{escape(note)}</p>' for note in nav.notes]
    section = None
    for e in nav.entries:
        if e.section != section:
            if section is not None:
                out.append("</ul>")
            out.append(f"<h4>{escape(e.section)}</h4><ul>")
            section = e.section
        label = f"{e.reward:g} &middot; {escape(e.id)}"
        link = f'<a href="{escape(e.href)}">{label}</a>' if e.href else label
        out.append(f'<li{" class=current" if e.id == current else ""}>{link}</li>')
    if section is not None:
        out.append("</ul>")
    out.append("</nav>")
    return "".join(out)


def render_episode_html(traj: Trajectory, title: str | None = None, *, tokenizer: Any = None, view: Any = None,
                        nav: Nav | None = None) -> str:
    """The whole episode as one HTML document (a str). `tokenizer` (the run's) decodes the prompt and the
    generated tokens; `view` (a k3rl.step_view.StepView) adds the group; `nav` the list of the step's others."""
    meta = traj.metadata
    rows = [
        ("episode", traj.id),
        ("environment", traj.env_id),
        ("seed", traj.seed),
        ("task", traj.task_id or "-"),
        ("group", traj.group_id or "-"),
        ("training step", meta.get("step", "-")),
        ("policy version", meta.get("policy_version", "-")),
        ("assistant turns", traj.num_turns),
        ("tokens", f"{len(traj.prompt_ids)} prompt + {len(traj.completion_ids)} completion "
                   f"({traj.num_generated} generated)"),
        ("policy versions", ", ".join(map(str, sorted({v for v in traj.versions if v >= 0}))) or "-"),
        ("context segments", len(traj.segment_bounds)),
    ]
    rows += [(f"time {k}", f"{v:.3f}s") for k, v in sorted(traj.timings.items())]
    more = [(k, json.dumps(v, ensure_ascii=False)) for k, v in sorted(meta.items())
            if k not in ("step", "policy_version", "reward_parts")]
    head = title or f"episode {traj.id}"
    summary = [traj.env_id, f"task {traj.task_id or '-'}", f"seed {traj.seed}", f"step {meta.get('step', '-')}",
               f"policy v{meta.get('policy_version', '-')}", f"{traj.num_turns} assistant turns",
               f"{traj.num_generated} generated tokens"]
    body = [f"<h1>{escape(head)}</h1>", f'<p class="info">{escape(" · ".join(summary))}</p>']
    body += _outcome(traj, view)
    body += _group(view, nav)
    body += _prompt(traj, tokenizer)
    body.append("<h2>The episode, turn by turn</h2>")
    advantages = iter(view.member.advantages or []) if view is not None and view.method else iter(())
    bounds = traj.segment_bounds
    for i, t in enumerate(traj.turns):
        if len(bounds) > 1 and (i == 0 or t.segment != traj.turns[i - 1].segment):
            lo, hi = bounds[t.segment]
            note = "" if t.segment == 0 else " (a new context: compaction, rollout.context)"
            body.append(f'<h2 class="segment" id="segment-{t.segment}">segment {t.segment}: tokens [{lo}, {hi})'
                        f"{escape(note)}</h2>")
        advantage = next(advantages, None) if t.role == "assistant" and t.compaction is None else None
        body.append(_turn(traj, i, t, tokenizer, advantage))
    body.append('<h2>Details</h2><details><summary>the episode\'s record</summary><table class="meta">'
                + "".join(f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in rows + more)
                + "</table></details>")
    sidebar = _nav(nav, traj.id) if nav is not None else ""
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{escape(head)}</title><style>{STYLE}</style></head>\n<body>\n{sidebar}<main>\n"
            + "\n".join(body) + "\n</main></body></html>\n")


def env_turns(t: Trajectory) -> list:
    return [turn for turn in t.turns if turn.role == "assistant" and turn.compaction is None]


def reward_parts(t: Trajectory) -> list[tuple[int, str, float]]:
    """(turn index, part, value) of every part the env reported, in order."""
    return [(int(p["turn"]), name, float(v)) for p in t.metadata.get("reward_parts") or []
            for name, v in p["parts"].items()]


def reward_note(t: Trajectory) -> str | None:
    """Why the episode's reward is not the sum of its parts, when it is not."""
    if t.error:
        return f"the episode failed ({t.metadata.get('failed_at', '?')}): reward 0, never trained"
    paid = sum(v for _, _, v in reward_parts(t))
    if t.truncated and t.metadata.get("truncated_by") in ("max_turns", "context", "max_tokens") and abs(paid) > 1e-9 \
            and t.reward == 0.0:
        return (f"the episode loop cut it ({t.metadata['truncated_by']}): reward 0 for the episode "
                f"(the turns keep what they were paid, {paid:g}, for per-turn advantages)")
    return None
