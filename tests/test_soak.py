"""The soak (benchmarks/soak.py) in a shortened form: a real `k3rl train` on the faulty KeyLookup, SIGKILL of
the driver after a checkpoint and a few more steps, its process tree killed (a machine-wide `k3rl sandbox gc`
would race the suite's other jobs starting), `--resume` to the end, watched from
outside (RSS of the driver and each actor class, the object store's bytes). The full soak (300 steps) is a
benchmark; here the store's guarantees are asserted and the measurements are shown to be taken."""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, KILL_AFTER = 24, 10

# the job runs beside the suite (tests/background.py)
BACKGROUND_JOBS = {"soak": lambda out: functools.partial(
    soak.soak, out, steps=STEPS, kill_after=KILL_AFTER, checkpoint_every=5, sample_s=1.0, warmup=2, window=3,
    into_next_s=3.0, progress=lambda _: None, gc=False)}


@pytest.mark.background("soak")
def test_a_killed_and_resumed_soak_keeps_every_episode_once_and_is_measured(background_job):
    report, _ = background_job
    v = report["verdicts"]
    assert report["gc_exit"] == 0 and v["resume_completed"], report["verdicts"]
    # the kill came after the checkpoint of step 10 and the resume redid what followed it
    assert report["last_step_before_kill"] >= KILL_AFTER
    store = report["store"]
    assert v["stored_once"] and v["every_step_p_groups"], store
    # a group trains on its members that did not fail: P x G a step at most; the injected tool deaths are
    # stored as failed episodes, never trained
    assert store["failed"] > 0 and STEPS * 2 * 4 - store["failed"] <= store["trained"] <= STEPS * 2 * 4, store
    # both segments were watched: the driver and every actor class, and the object store
    for segment in (0, 1):
        samples = [s for s in report["samples"] if s["segment"] == segment]
        assert {"driver", *soak.ROLES} <= {r for s in samples for r in s["rss"]}, segment
        assert any(s["object_store"] is not None for s in samples), segment
    segments = report["analysis"]["segments"]
    assert len(segments) == 2 and all("step_trend_per_100" in s for s in segments), segments
    # a gross leak shows even in 24 steps (the 10% bound is the full soak's, over 300)
    assert all(g is None or g < 0.5 for s in segments for g in s["rss_growth"].values()), segments
