"""`k3rl replay`: episodes recorded by the real episode loop into a real store, shown, written as
HTML, and re-executed in fresh environments (a Gymnasium env with images defined here, and the
built-in k3rl/KeyLookup-v0)."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path
from types import SimpleNamespace

import gymnasium
import pytest
from PIL import Image
from rich.console import Console
from test_store import make_episode
from typer.testing import CliRunner

from k3rl.chat import OPEN, SEP, Message, ToolCallParseError
from k3rl.config import JobConfig
from k3rl.images import to_png
from k3rl.reexecute import re_execute_episode
from k3rl.replay import replay_command
from k3rl.rollout.episode import EpisodeSpec, make_template, run_episode
from k3rl.store import TrajectoryStore
from k3rl.types import SamplingParams, ToolCall

TEMPLATE = make_template(JobConfig())  # the template the job (and so the re-execution) uses
ADDER = "k3rltest/Adder-v0"


def bar(n: int) -> bytes:
    """An image of the number n: a (n+1) x 3 strip, brighter for larger n."""
    return to_png(Image.new("RGB", (n + 1, 3), (min(255, 10 * n), 80, 160)))


class AdderEnv(gymnasium.Env):
    """Add two numbers with the `add` tool, then answer. Observations carry images.
    `offset` changes what the tool returns (a changed environment, for divergence).
    An ordinary Gymnasium env (not a ToolEnv): it gets the assistant Message the episode loop
    parsed, or the sampled ids when they did not parse."""

    # messages in, messages out; the spaces only describe them loosely (as text)
    action_space = gymnasium.spaces.Text(4096)
    observation_space = gymnasium.spaces.Text(4096)

    def __init__(self, offset: int = 0, max_turns: int = 4) -> None:
        self.offset, self.max_turns = offset, max_turns

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.a, self.b = (int(x) for x in self.np_random.integers(0, 20, size=2))
        self.turn = 0
        return [{"role": "user", "content": f"add {self.a} and {self.b}", "images": [bar(self.a)]}], {"task_id": f"{self.a}+{self.b}"}

    def step(self, action):
        self.turn += 1
        if isinstance(action, list):  # the ids did not parse: say why
            try:
                TEMPLATE.parse_assistant(action)
            except ToolCallParseError as e:
                msgs = [{"role": "user", "content": f"Error: could not parse ({e})"}]
                return msgs, 0.0, False, self.turn >= self.max_turns, {}
        assert isinstance(action, Message) and action.role == "assistant"
        if not action.tool_calls:
            reward = 1.0 if action.content.strip() == str(self.a + self.b) else 0.0
            return [], reward, True, False, {}
        msgs = []
        for i, call in enumerate(action.tool_calls, start=1):
            value = call.arguments["a"] + call.arguments["b"] + self.offset
            msgs.append({"role": "tool", "content": str(value), "images": [bar(value)], "tool_name": "add", "tool_index": i})
        return msgs, 0.0, False, self.turn >= self.max_turns, {}


gymnasium.register(id=ADDER, entry_point=AdderEnv)


def adder_oracle(env: AdderEnv):
    """A scripted policy: one malformed message, then the tool call, then the answer."""
    script = iter([
        [TEMPLATE.tok.special(OPEN)] + TEMPLATE.tok.encode("bogus") + [TEMPLATE.tok.special(SEP)] + TEMPLATE.end_of_message,
        lambda: TEMPLATE.assistant_body("", [ToolCall(name="add", arguments={"a": env.a, "b": env.b})], None),
        lambda: TEMPLATE.assistant_body(str(env.a + env.b), [], None),
    ])
    return lambda: (lambda x: x() if callable(x) else x)(next(script))


def keylookup_oracle(env):
    from k3rl.envs import action_to_ids

    return lambda: action_to_ids(TEMPLATE, env.oracle())


def record(env_id: str, seed: int, episode_id: str, step: int, oracle, **env_kwargs):
    """One episode through the real episode loop, with a scripted policy in place of the model."""
    kw = {"template": TEMPLATE} if env_id.startswith("k3rl/") else {}
    env = gymnasium.make(env_id, **env_kwargs, **kw).unwrapped
    policy = oracle(env)
    version = step

    async def generate(token_ids, sampling, images=None, key=None, **kw):
        ids = policy()
        return SimpleNamespace(token_ids=ids, logprobs=[-0.25] * len(ids), versions=[version] * len(ids),
                               finish_reason="stop")

    spec = EpisodeSpec(id=episode_id, env_id=env_id, seed=seed, group_id=f"g{seed}", env_kwargs=env_kwargs)
    traj = asyncio.run(run_episode(lambda: env, spec, generate, TEMPLATE, SamplingParams(), max_turns=4,
                                   max_context_tokens=8192))
    assert traj.error is None, traj.error
    assert traj.metadata["env_kwargs"] == env_kwargs  # the episode loop records them
    # these recordings exercise the fallback for episodes that did not record their kwargs:
    # re-execution then takes them from the run's config.yaml
    traj.metadata.pop("env_kwargs")
    traj.metadata.update(step=step, policy_version=version)
    return traj


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "runs" / "demo"
    cfg = JobConfig.from_dict({"name": "demo", "envs": {"train": [{"id": ADDER, "kwargs": {"offset": 0}}], "max_turns": 4}})
    cfg.save(run / "config.yaml")
    with TrajectoryStore(run) as store:
        for i in range(3):
            store.append(record(ADDER, seed=i, episode_id=f"adder{i:02d}", step=i // 2, oracle=adder_oracle, offset=0))
    return run


def console() -> Console:
    return Console(record=True, width=400, color_system=None)


def test_show_episode_and_html(run_dir, tmp_path):
    c = console()
    out = tmp_path / "page" / "ep.html"
    assert replay_command(str(run_dir), episode="adder01", html=out, console=c) == 0
    text = c.export_text()
    traj = TrajectoryStore(run_dir, readonly=True).read(episode="adder01")[0]
    assert [t.role for t in traj.turns] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert traj.reward == 1.0 and traj.terminated
    a, b = (int(x) for x in traj.task_id.split("+"))
    assert f"add {a} and {b}" in text
    assert "-> call 1 add(" in text and f'{{"a": {a}, "b": {b}}}' in text
    assert "Error: could not parse" in text and "malformed assistant message" in text  # the turn's parse error
    # images: their size and where the PNG lies
    first_png = run_dir / "images" / "adder01" / "0_0.png"
    assert f"[image 0: {a + 1}x3 PNG" in text and str(first_png) in text.replace("\n", "")
    assert "policy v0" in text and "reward 1" in text
    page = out.read_text()
    imgs = [base64.b64decode(s) for s in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)]
    assert imgs == traj.images == [bar(a), bar(a + b)]
    assert "Error: could not parse" in page and "malformed" in page


def test_selection_and_bad_input(run_dir, tmp_path):
    c = console()
    assert replay_command(str(run_dir), step=0, console=c) == 0  # two episodes, both at 1: the first shown
    text = c.export_text()
    assert "step 0: 2 trained; showing the best trained episode" in text and "episode  adder00" in text
    c = console()
    assert replay_command(str(run_dir), console=c) == 0  # the last step's
    assert "episode  adder02" in c.export_text()
    c = console()
    assert replay_command(str(run_dir), step=7, console=c) == 2
    assert "no trained episode at step 7" in c.export_text()
    c = console()
    assert replay_command(None, runs_dir=run_dir.parent, console=c) == 0  # no run named: the newest
    assert f"run {run_dir} (the newest" in c.export_text().replace("\n", "")
    c = console()
    assert replay_command(str(run_dir), episode="adder", console=c) == 2
    assert "3 episodes start with 'adder': give more of the id" in c.export_text()
    c = console()
    assert replay_command(str(run_dir), episode="zzz", console=c) == 2
    text = c.export_text()
    assert "no episode with id starting with 'zzz'" in text and "steps 0-1" in text
    c = console()
    assert replay_command(str(tmp_path / "nope"), console=c) == 2
    text = c.export_text()
    assert "no run" in text and "not a run folder" in text and "`k3rl runs` lists the runs" in text
    # an episode of an environment that is not registered (any more) cannot be re-executed
    with TrajectoryStore(tmp_path / "gone", flush_every=1) as store:
        store.append(make_episode(1))
    c = console()
    assert replay_command(str(tmp_path / "gone"), re_execute=True, console=c) == 2
    text = c.export_text()
    assert "ep00001" in text and "cannot make environment 'k3rl/Test-v0'" in text


def test_re_execute_identical_then_divergent(run_dir):
    c = console()
    assert replay_command(str(run_dir), episode="adder02", re_execute=True, console=c) == 0
    assert "identical: 3 steps re-executed" in c.export_text()
    # the environment changed since the run: the tool now answers a+b+1
    cfg = JobConfig.load(run_dir / "config.yaml", ["envs.train.0.kwargs.offset=1"])
    cfg.save(run_dir / "config.yaml")
    c = console()
    assert replay_command(str(run_dir), episode="adder02", re_execute=True, console=c) == 1
    text = c.export_text()
    assert "divergences in 3 re-executed steps" in text
    assert "text differs" in text and "images differ" in text
    traj = TrajectoryStore(run_dir, readonly=True).read(episode="adder02")[0]
    result = re_execute_episode(traj, {"offset": 1})
    a, b = (int(x) for x in traj.task_id.split("+"))
    # exactly the tool turn diverges (text and image); the answer was recorded, so the reward still matches
    assert [(d.turn, d.what, d.recorded, d.replayed) for d in result.divergences][0] == (
        4, "message 0: text differs", str(a + b), str(a + b + 1))
    assert [d.what for d in result.divergences] == ["message 0: text differs", "message 0: images differ"]
    # a recording the env can no longer reproduce at all: wrong seed -> the prompt differs at reset
    traj.seed = traj.seed + 100
    moved = re_execute_episode(traj, {"offset": 0})
    assert (moved.divergences[0].turn, moved.divergences[0].what) == (0, "message 0: text differs")


def test_cli_and_builtin_env(tmp_path):
    """The real k3rl replay command on an episode of the built-in KeyLookup env (no sandbox)."""
    pytest.importorskip("k3rl.envs")
    from k3rl.cli import app

    run = tmp_path / "kl"
    with TrajectoryStore(run) as store:
        store.append(record("k3rl/KeyLookup-v0", seed=11, episode_id="kl-ep", step=0, oracle=keylookup_oracle))
    result = CliRunner().invoke(app, ["replay", str(run), "--re-execute"])
    assert result.exit_code == 0, result.output
    assert "identical: 2 steps re-executed" in result.output and "lookup" in result.output
    result = CliRunner().invoke(app, ["replay", str(run), "--episode", "missing"])
    assert result.exit_code == 2 and "no episode with id starting with 'missing'" in result.output


def test_re_execute_reproduces_a_truncated_episode(tmp_path):
    """An episode whose message the engine cut at max_tokens re-executes identically (the loop ends it
    there both times; the env is not handed the cut message)."""
    from k3rl.rollout.episode import scripted_generate

    env = gymnasium.make("k3rl/KeyLookup-v0", template=TEMPLATE).unwrapped
    spec = EpisodeSpec(id="cut-ep", env_id="k3rl/KeyLookup-v0", seed=3, group_id="g")
    traj = asyncio.run(run_episode(lambda: env, spec, scripted_generate(TEMPLATE, env.oracle), TEMPLATE,
                                   SamplingParams(max_tokens=30), max_turns=4, max_context_tokens=8192))
    assert traj.truncated and traj.metadata["truncated_by"] == "max_tokens" and traj.num_generated == 30
    result = re_execute_episode(traj, {})
    assert result.identical and result.steps == 1, result.divergences


# -- an episode among its step: a KeyLookup run recorded through the real episode loop -------------------
DEMO_KL = {"num_keys": 2, "value_digits": 1, "key_letters": "abcd", "key_digit": False, "partial_credit": True,
           "turn_rewards": True}


def _keylookup_policy(env, plan: str):
    """A scripted KeyLookup player: "right" (the oracle), "wrong_key" (looks up the other key, answers its
    value), "wrong_value" (the right key, then a wrong answer)."""
    def act():
        task, said = env.task, [m for m in env.history if m.role == "assistant"]
        if not said:
            key = task.key if plan != "wrong_key" else next(k for k in task.keys if k != task.key)
            return action_ids(env.say(tool_calls=[{"name": "lookup", "arguments": {"key": key}}]))
        looked = [m for m in env.history if m.role == "tool"][-1].content
        return action_ids(env.say(looked if plan != "wrong_value" else str((int(looked) + 1) % 10)))
    return act


def action_ids(text: str) -> list[int]:
    from k3rl.envs import action_to_ids

    return action_to_ids(TEMPLATE, text)


def play_keylookup(episode_id: str, group_id: str, seed: int, plan: str, step: int, status: str,
                   fail: bool = False, version: int = 1):
    """One KeyLookup episode (the demo's kwargs) through the episode loop, tagged as the store tags it. Its
    sampled tokens get log-probs that vary (0, -0.8, -1.6, ...) so a page shades them differently."""
    env = gymnasium.make("k3rl/KeyLookup-v0", template=TEMPLATE, **DEMO_KL).unwrapped
    policy = _keylookup_policy(env, plan)

    async def generate(token_ids, sampling, images=None, key=None, **kw):
        if fail:
            raise RuntimeError("the engine died")
        ids = policy()
        return SimpleNamespace(token_ids=ids, logprobs=[-0.8 * (k % 5) for k in range(len(ids))],
                               versions=[version] * len(ids), finish_reason="stop")

    spec = EpisodeSpec(id=episode_id, env_id="k3rl/KeyLookup-v0", seed=seed, group_id=group_id, env_kwargs=DEMO_KL)
    traj = asyncio.run(run_episode(lambda: env, spec, generate, TEMPLATE, SamplingParams(), max_turns=3,
                                   max_context_tokens=1024))
    assert bool(traj.error) == fail, traj.error
    traj.metadata.update(step=step, policy_version=version, status=status)
    return traj


def keylookup_run(root: Path) -> Path:
    """A run folder as a KeyLookup job leaves it (config.yaml, episodes at steps 0 and 1): step 1 trains two
    groups (g0: four samples at 1, 0.25, 0.5, 1; g1: one at 1 and one that failed) and evaluates one task."""
    run = root / "kl-run"
    cfg = JobConfig.from_dict({"name": "kl-run", "learner": {"advantage": "turn_grpo_no_std", "format_penalty": 0.3},
                               "envs": {"train": [{"id": "k3rl/KeyLookup-v0", "kwargs": DEMO_KL}], "max_turns": 3}})
    cfg.save(run / "config.yaml")
    with TrajectoryStore(run) as store:
        store.append(play_keylookup("kl-run-eval-g0000000-s0", "kl-run-eval-g0000000", 2**31 + 7, "wrong_key", 0,
                                    "eval", version=0))
        for k, plan in enumerate(["right", "wrong_key", "wrong_value", "right"]):
            store.append(play_keylookup(f"kl-run-g0000000-s{k}", "kl-run-g0000000", 11, plan, 1, "trained"))
        store.append(play_keylookup("kl-run-g0000001-s0", "kl-run-g0000001", 12, "right", 1, "trained"))
        store.append(play_keylookup("kl-run-g0000001-s1", "kl-run-g0000001", 12, "right", 1, "failed", fail=True))
        gid = "kl-run-eval000001-KeyLookup-v0-t0000"
        for member, plan in (("greedy", "right"), ("s0", "wrong_value")):
            store.append(play_keylookup(f"{gid}-{member}", gid, 2**31 + 9, plan, 1, "eval", version=2))
    return run


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    return keylookup_run(tmp_path_factory.mktemp("kl"))


def test_replay_shows_the_best_trained_episode_of_the_last_step_among_its_group(kl_run):
    c = console()
    assert replay_command(str(kl_run), console=c) == 0
    text = c.export_text()
    assert "step 1: 5 trained, 2 eval, 1 failed; showing the best trained episode" in text
    assert "episode  kl-run-g0000000-s0" in text and re.search(r"reward +1 \(terminated\)", text)
    # its group, with the trainer's per-turn advantages (turn_grpo_no_std): returns G_0 = 1, .25, .5, 1 (mean
    # .6875), G_1 = .5, 0, 0, .5 (mean .25); A = G - mean
    assert "its group kl-run-g0000000: 4 samples of one prompt, baseline 0.688" in text
    row = next(line for line in text.splitlines() if "│ s1 " in line)
    assert "0.25" in row and "-0.438 / -0.250" in row and "trained" in row
    assert "+0.312 / +0.250" in next(line for line in text.splitlines() if "│ s0 " in line)
    assert "reward parts (the env's): #1 requested_key 0.25, #1 valid_key 0.25, #3 exact_value 0.5  = 1" in text

    c = console()
    assert replay_command(str(kl_run), worst=True, console=c) == 0  # the worst trained: the wrong key
    text = c.export_text()
    assert "showing the worst trained episode" in text and "episode  kl-run-g0000000-s1" in text
    assert "#1 requested_key 0, #1 valid_key 0.25, #3 exact_value 0  = 0.25" in text

    c = console()
    assert replay_command(str(kl_run), failed=True, console=c) == 0
    text = c.export_text()
    assert "showing a failed episode" in text and "episode  kl-run-g0000001-s1" in text
    assert "RuntimeError: the engine died" in text
    assert "the episode failed (generate): reward 0, never trained" in text

    c = console()
    assert replay_command(str(kl_run), eval_=True, console=c) == 0  # the step's eval, apart from training's
    text = c.export_text()
    assert "episode  kl-run-eval000001-KeyLookup-v0-t0000-greedy" in text and "advantage (not trained)" in text
    c = console()
    assert replay_command(str(kl_run), eval_=True, step=0, console=c) == 0  # the starting policy's, at step 0
    assert "episode  kl-run-eval-g0000000-s0" in c.export_text()
    c = console()
    assert replay_command(str(kl_run), failed=True, step=0, console=c) == 2
    text = c.export_text()
    assert "no failed episode at step 0" in text and "failed episodes at steps 1" in text


def test_replay_html_shows_the_group_the_tokens_and_the_steps_other_pages(kl_run, tmp_path):
    from html.parser import HTMLParser

    page = tmp_path / "pages" / "ep.html"
    c = console()
    assert replay_command(str(kl_run), worst=True, html=page, console=c) == 0
    assert f"wrote {page} and 4 more trained episodes of step 1 beside it" in c.export_text().replace("\n", "")
    html = page.read_text()
    traj = TrajectoryStore(kl_run, readonly=True).read(episode="kl-run-g0000000-s1")[0]
    # the group: every member, this one marked, its per-turn advantages
    assert '<tr class="current"><td>kl-run-g0000000-s1</td><td class="num">0.25</td><td class="num">-0.438 / -0.250</td>' \
        in html
    assert "baseline (mean reward) 0.688" in html and "turn_grpo_no_std" in html
    # the reward's parts as the env reported them, per turn
    assert "<td>valid_key</td><td class=\"num\">0.25</td>" in html and "<td>requested_key</td><td class=\"num\">0</td>" in html
    # the raw generated tokens beside the parsed call, each with its log-prob on hover
    assert "generated: " in html and "parsed by the episode loop" in html
    tokens = re.findall(r'<span class="tok ?(p\d)?( sp)?" title="([^"]*)">', html)
    said = [t for t in traj.turns if t.role == "assistant"]
    assert len(tokens) == sum(t.end - t.start - len(TEMPLATE.generation_prefix()) for t in said)  # one per token
    assert "log-prob -0.8000 (p 0.449), policy v1" in html and {s for s, _, _ in tokens} >= {"", "p2", "p3", "p4"}
    assert any(sp for _, sp, _ in tokens)  # the template's special tokens, greyed
    # the prompt, decoded (collapsed)
    assert "the rendered prompt: " in html and f"keys {' '.join(traj.task_id.split('|')[0].split())}" in html
    # the step's other trained episodes: listed, linked, written
    links = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "a" and dict(attrs).get("href", "").endswith(".html"):
                links.append(dict(attrs)["href"])

    Links().feed(html)
    siblings = {f"ep_step1/kl-run-g0000000-s{k}.html" for k in (0, 2, 3)} | {"ep_step1/kl-run-g0000001-s0.html"}
    assert siblings <= set(links) and all((page.parent / link).is_file() for link in links)
    other = (page.parent / "ep_step1" / "kl-run-g0000000-s0.html").read_text()
    assert '<a href="../ep.html">0.25 &middot; kl-run-g0000000-s1</a>' in other  # and back
    assert "2 eval: k3rl replay" in html and "--eval --step 1" in html  # what else the step holds, and how to see it
