"""`k3rl train` with learner.lora on k3-tiny through the real loop (Ray, the embedded engine, MLflow
on SQLite): only the adapters change in the learner, the engines run each new version (the
learner's log-probs equal the engines' at lag 0), the weight sync carries the adapters alone and
the checkpoints hold them in the PEFT layout."""

import functools
import json
from pathlib import Path

import pytest
import torch
from background import k3rl_train

pytestmark = pytest.mark.slow


def _lora_job(out: Path):
    runs, uri = out / "runs", f"sqlite:///{out}/runs/mlflow.db"
    sets = ["name=lora", "tracking.run_name=lora", "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_policy_lag=0",
            "learner.steps=2", "learner.checkpoint_every=1", "learner.sft_steps=2", "learner.sft_phases=[]", "learner.sft_episodes=4",
            "learner.sft_lr=0.05", "learner.lr=0.05", "learner.eval_before_training=false", "tracking.eval_every=0",
            "envs.eval=[]",  # no held-out eval (the demo's 64 tasks x 5 before step 1 took most of the test's time)
            "learner.lora.rank=4", "learner.lora.alpha=8", "learner.lora.sync=adapters",
            "learner.lora.targets=[attention,shared_experts,routed_experts,latent]",
            f"tracking.runs_dir={runs}", f"tracking.uri={uri}", "ray.num_cpus=4"]
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo_from_scratch.yaml"  # KeyLookup, KL on: k3-tiny
    return functools.partial(k3rl_train, out, [str(demo), *(a for s in sets for a in ("--set", s))])


# the job runs beside the suite (tests/background.py): `k3rl train` of the demo with LoRA
BACKGROUND_JOBS = {"lora": _lora_job}


@pytest.mark.background("lora")
def test_lora_rl_job_trains_only_the_adapters_and_the_engines_merge_them(background_job):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from k3rl.config import LoraSection
    from k3rl.model import build_model, load_state_into
    from k3rl.model.lora import PEFT_PREFIX, apply_lora, load_peft_adapter

    r, out = background_job
    runs, uri = out / "runs", f"sqlite:///{out}/runs/mlflow.db"
    assert r["returncode"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]

    summary = json.loads((runs / "lora" / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 2
    client = MlflowClient(tracking_uri=uri)
    run_id = summary["mlflow_run_id"]
    metric = {k: [m.value for m in client.get_metric_history(run_id, k)]
              for k in ("policy_version", "staleness/max", "is_ratio_mean", "weight_sync/bytes")}
    assert metric["policy_version"] == [1.0, 2.0] and metric["staleness/max"] == [0.0, 0.0]
    # step 2 sampled from version 2, which the engines built by merging the step-1 adapters into their
    # base: the learner's recomputed log-probs of those tokens equal the engines' (ratio 1)
    assert all(abs(x - 1.0) < 2e-3 for x in metric["is_ratio_mean"])

    ckpts = runs / "lora" / "checkpoints"
    base = build_model("k3-tiny", seed=0)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    adapters = []
    for step in (1, 2):
        d = ckpts / f"step-{step:06d}"
        assert json.loads((d / "adapter" / "adapter_config.json").read_text())["r"] == 4
        adapters.append(load_file(str(d / "adapter" / "adapter_model.safetensors")))
        load_state_into(base, d / "model")
        assert all(torch.equal(v, plain[k]) for k, v in base.state_dict().items())  # the base never moved
    assert set(adapters[0]) == set(adapters[1]) and all(k.startswith(PEFT_PREFIX) for k in adapters[0])
    assert any(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])  # the adapters trained
    # version 2 (base + the step-1 adapters) is far enough from the base that an engine that had not
    # merged them would have sampled with other log-probs than the learner's (ratio 1 above)
    adapted = build_model("k3-tiny", seed=0)
    apply_lora(adapted, LoraSection(rank=4, alpha=8, targets=["attention", "shared_experts", "routed_experts",
                                                                "latent"]).settings())
    load_peft_adapter(adapted, ckpts / "step-000001" / "adapter")
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moved = (adapted(ids).log_softmax(-1) - base(ids).log_softmax(-1)).abs().max()
    assert moved > 0.05, float(moved)
    # one sync carried the adapters (fp32) and the scaling: r (in + out) values per adapted weight
    sent = sum(v.numel() * 4 for v in adapters[0].values())
    assert sent <= metric["weight_sync/bytes"][0] <= sent + 16 * (len(adapters[0]) + 1)
    weights = sum(v.numel() * v.element_size() for v in plain.values())
    assert weights / metric["weight_sync/bytes"][0] > 10
