"""LoRA on k3-tiny: only the adapters train, the merge is W + s * B @ A, the adapters alone are small, PEFT layout."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from k3rl.model import build_model
from k3rl.model.lora import (
    ATTENTION,
    LATENT,
    ROUTED_EXPERTS,
    SHARED_EXPERTS,
    LoraSettings,
    adapter_state_dict,
    adapters_of,
    apply_lora,
    load_peft_adapter,
    merged_state_dict,
    save_peft_adapter,
)

SETTINGS = LoraSettings(rank=4, alpha=8, dropout=0.0, targets=ATTENTION + SHARED_EXPERTS + ROUTED_EXPERTS + LATENT)


def adapted(seed=0, settings=SETTINGS):
    model = build_model("k3-tiny", seed=seed)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, settings)
    return model, base


def tokens(model, n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (2, n), generator=g)


def nudge_b(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters_of(model).values():
            adapter.lora_B.copy_(0.02 * torch.randn(adapter.lora_B.shape, generator=g))


def test_every_target_group_is_adapted_and_a_fresh_adapter_changes_nothing():
    model, _ = adapted()
    plain = build_model("k3-tiny", seed=0)
    names = list(adapters_of(model))
    for needle in ("self_attn.q_proj.weight", "shared_experts.up_proj.weight", "mlp.experts.w1",
                   "routed_expert_down_proj.weight"):
        assert any(needle in n for n in names), needle
    ids = tokens(model)
    torch.testing.assert_close(model(ids), plain(ids))  # B = 0
    with pytest.raises(ValueError, match="no weight of the model matches"):
        apply_lora(build_model("k3-tiny", seed=0), LoraSettings(targets=["nothing_like_this"]))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_rl_steps_of_the_trainer_change_only_the_adapters(optimizer):
    """Two GRPO steps of the learner's Trainer (Per-Head Muon or AdamW) on a LoRA-adapted k3-tiny."""
    from learner_helpers import make_trajectories

    from k3rl.config import LearnerSection
    from k3rl.learner.trainer import Trainer

    torch.manual_seed(0)
    model, base = adapted()
    trainer = Trainer(model, LearnerSection(micro_batch_tokens=64, steps=10, optimizer=optimizer, lr=1e-2))
    adapter_params = {id(p) for a in adapters_of(model).values() for p in a.parameters()}
    assert {id(p) for p in trainer.trainable} == adapter_params  # the optimizer holds the adapters only
    for step in range(2):  # step 1 moves B off zero, step 2 then moves A too
        stats = trainer.train_step(make_trajectories(seed=step))  # byte tokens, no media placeholders
        assert stats["sequences"] == 8
    merged = merged_state_dict(model)
    assert set(merged) == set(base)
    frozen = {k: v for k, v in model.state_dict().items() if not k.startswith("lora_adapters.")
              and ".parametrizations." not in k}
    assert all(torch.equal(v, base[k]) for k, v in frozen.items())  # base weights untouched
    assert all(a.lora_B.abs().sum() > 0 for a in adapters_of(model).values())
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert sorted(changed) == sorted(adapters_of(model))  # the merged model differs exactly at the targets


def test_merged_weights_are_base_plus_ba_and_compute_the_same_function():
    model, base = adapted()
    nudge_b(model)
    merged = merged_state_dict(model)
    for name, adapter in adapters_of(model).items():
        expected = base[name] + SETTINGS.scaling * adapter.lora_B.detach() @ adapter.lora_A.detach()
        torch.testing.assert_close(merged[name], expected)
    plain = build_model("k3-tiny", seed=0)
    plain.load_state_dict(merged)
    ids = tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), model(ids), rtol=1e-4, atol=1e-4)


def test_the_adapters_alone_are_smaller_by_the_expected_factor():
    model, base = adapted()
    sent = sum(t.numel() * t.element_size() for t in adapter_state_dict(model).values())
    full = sum(t.numel() * t.element_size() for t in merged_state_dict(model).values())
    r = SETTINGS.rank
    expected = sum(r * (w.shape[-1] + w.shape[-2]) * (w.shape[0] if w.dim() == 3 else 1) * w.element_size()
                   for name, w in base.items() if name in adapters_of(model))
    assert sent == expected
    print(f"LoRA r={r}: adapters {sent} B vs full {full} B ({full / sent:.1f}x smaller)")
    assert full / sent > 5


def test_peft_layout_round_trips(tmp_path):
    model, _ = adapted()
    nudge_b(model)
    save_peft_adapter(model, tmp_path / "adapter", SETTINGS, base_model="k3-tiny")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1" in config["target_modules"]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    q = next(k for k in saved if k.endswith("self_attn.q_proj.lora_A.weight"))
    assert q.startswith("base_model.model.language_model.model.layers.") and saved[q].shape[0] == 4
    assert saved[q.replace("lora_A", "lora_B")].shape[1] == 4
    fresh, _ = adapted(seed=0)
    load_peft_adapter(fresh, tmp_path / "adapter")
    ids = tokens(model)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), model(ids))


# PEFT runs in a fresh interpreter started outside the repository, as a user's would (transformers >= 5.25
# imports Hugging Face's `kernels` package with PEFT; from the repository root, tests/kernels/test_package_name.py).
PEFT_READS = """
import json, sys
import peft
weights = peft.utils.load_peft_weights(sys.argv[1])
config = peft.LoraConfig.from_pretrained(sys.argv[1])
print(json.dumps({"keys": sorted(weights), "r": config.r, "alpha": config.lora_alpha,
                  "lora": config.peft_type == peft.PeftType.LORA, "targets": sorted(config.target_modules)}))
"""


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_peft_reads_the_adapter(tmp_path):
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed (pip install peft)")
    model, _ = adapted()
    save_peft_adapter(model, tmp_path / "adapter", SETTINGS, base_model="k3-tiny")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", PEFT_READS, str(tmp_path / "adapter")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    read = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(read["keys"]) == set(adapter_state_dict(model))
    assert (read["r"], read["alpha"], read["lora"]) == (4, 8, True)
    assert "language_model.model.layers.0.self_attn.q_proj" in read["targets"]


# ----- wired through the learner: config, weight sync to a real engine, checkpoints ---------------------------
ALL_GROUPS = ["attention", "shared_experts", "routed_experts", "latent"]


def lora_trainer(seed=0, sync="adapters", **cfg):
    from k3rl.config import LearnerSection, LoraSection
    from k3rl.learner.trainer import Trainer

    cfg.setdefault("micro_batch_tokens", 64)
    cfg.setdefault("steps", 10)
    cfg.setdefault("lr", 1e-2)
    lora = LoraSection(rank=4, alpha=8, targets=ALL_GROUPS, sync=sync, optimizer=cfg.pop("optimizer", "adamw"))
    return Trainer(build_model("k3-tiny", seed=seed), LearnerSection(lora=lora, **cfg))


def test_config_groups_expand_to_the_patterns_and_bad_settings_are_refused():
    from k3rl.config import ConfigError, JobConfig, LoraSection

    assert LoraSection(targets=["attention", r"q_proj\.weight$"]).settings().targets == [*ATTENTION, r"q_proj\.weight$"]
    assert JobConfig().learner.lora is None  # off unless asked for
    kinds = {o: {g["kind"] for g in lora_trainer(optimizer=o).optimizer.param_groups} for o in ("adamw", "muon")}
    assert kinds["adamw"] == {"adamw"} and "adamw" not in kinds["muon"]  # lora.optimizer picks the adapters' one
    cfg = JobConfig.load(None, ["learner.lora.rank=4", "learner.lora.targets=[attention,routed_experts]"])
    assert cfg.learner.lora.settings().targets == ATTENTION + ROUTED_EXPERTS and cfg.learner.lora.sync == "adapters"
    for bad, where in ((["learner.lora.targets=['(']"], "learner.lora.targets.0"),
                       (["learner.lora.rank=4", "learner.data_parallel=fsdp", "learner.world_size=2"], "learner.lora"),
                       (["learner.lora.rank=4", "learner.qk_clip_tau=100"], "learner.lora"),
                       (["learner.lora.sync=adapters", "learner.qb_frozen=false"], "learner.lora.sync")):
        with pytest.raises(ConfigError, match=where.replace(".", r"\.") + ": "):
            JobConfig.load(None, bad)


def test_adapters_sync_is_smaller_by_the_expected_factor_and_the_engine_merges_each_version_into_its_base():
    """A real EmbeddedEngine on the same k3-tiny: after each adapters-only update its weights equal
    the learner's merged weights W + s * B @ A (v2 is merged into the base, not into v1's merge)."""
    from learner_helpers import make_trajectories

    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.transport import PackedUpdate

    torch.manual_seed(0)
    t = lora_trainer()
    engine = EmbeddedEngine.from_preset("k3-tiny", seed=0)
    try:
        for version in (1, 2):
            t.train_step(make_trajectories(seed=version))
            update = t.export_weights(version)
            assert engine.update_weights(update) == version
            merged = merged_state_dict(t.model)
            got = engine.model.state_dict()
            assert set(merged) == set(got)
            for name, value in merged.items():
                torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
        plain_names = set(merged_state_dict(t.model)) - set(adapters_of(t.model))
        base = build_model("k3-tiny", seed=0).state_dict()
        assert all(torch.equal(got[n], base[n]) for n in plain_names)  # nothing else moved
        # whole weights (another model's) become the base the next adapters are merged into
        from k3rl.model.state_dict_adapter import to_hf
        from k3rl.types import WeightUpdate

        other = build_model("k3-tiny", seed=5).state_dict()
        engine.update_weights(WeightUpdate.from_state_dict(3, to_hf(other, experts="dense")))
        engine.update_weights(t.export_weights(4))
        got = engine.model.state_dict()
        for name, adapter in adapters_of(t.model).items():
            expected = other[name] + adapter.delta().detach()
            torch.testing.assert_close(got[name], expected, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        engine.close()
    # bytes on the wire (what the transports report as weight_sync/bytes): the adapters (fp32) vs every weight
    sent = PackedUpdate.pack(t.export_weights(3)).nbytes
    full = PackedUpdate.pack(lora_trainer(sync="merged").export_weights(3)).nbytes
    r = 4
    adapter_bytes = sum(r * (w.shape[-1] + w.shape[-2]) * (w.shape[0] if w.dim() == 3 else 1) * 4
                        for name, w in base.items() if name in adapters_of(t.model))
    weight_bytes = sum(w.numel() * w.element_size() for w in base.values())
    assert adapter_bytes <= sent <= adapter_bytes + 16 * 4 * len(base)  # + 16-byte alignment per tensor
    assert weight_bytes <= full <= weight_bytes + 16 * len(base) * 8
    print(f"adapters sync {sent} B, merged sync {full} B: {full / sent:.1f}x smaller "
          f"(expected {weight_bytes / adapter_bytes:.1f}x)")
    assert full / sent == pytest.approx(weight_bytes / adapter_bytes, rel=0.05)


def test_merged_sync_sends_base_plus_ba_under_the_release_names():
    from k3rl.model.state_dict_adapter import to_hf

    t = lora_trainer(sync="merged")
    nudge_b(t.model)
    sent = t.export_weights(1).state_dict()
    expected = to_hf(merged_state_dict(t.model), experts="dense")
    assert set(sent) == set(expected)
    assert all(torch.equal(sent[k], expected[k]) for k in expected)


def test_kl_reference_stays_the_base_model():
    from learner_helpers import make_trajectories

    torch.manual_seed(0)
    t = lora_trainer(kl_coef=0.1)
    t.train_step(make_trajectories(seed=0))
    t.train_step(make_trajectories(seed=1))
    t.reset_reference()
    base = build_model("k3-tiny", seed=0).state_dict()
    ref = t.reference.state_dict()
    assert not hasattr(t.reference, "lora_adapters") and all(torch.equal(ref[k], base[k]) for k in base)
    ids = tokens(t.model)
    with torch.no_grad():
        assert not torch.allclose(t.reference(ids), t.model(ids))  # the policy moved, the reference did not


def test_checkpoint_holds_the_peft_adapter_and_resume_is_bit_identical(tmp_path):
    from learner_helpers import make_trajectories

    from k3rl.model.lora import base_state_dict

    batches = [make_trajectories(s) for s in range(4)]
    torch.manual_seed(0)
    a = lora_trainer(kl_coef=0.1, optimizer="muon")
    a.train_step(batches[0])
    a.train_step(batches[1])
    a.save_checkpoint(tmp_path)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    ref = [a.train_step(batches[2]), a.train_step(batches[3])]
    b = lora_trainer(seed=123, kl_coef=0.1, optimizer="muon")  # other base weights and adapters: everything comes from the checkpoint
    b.load_checkpoint(tmp_path)
    assert b.step == 2
    got = [b.train_step(batches[2]), b.train_step(batches[3])]
    for r, g in zip(ref, got, strict=True):
        for key in ("loss", "pg_loss", "kl", "grad_norm", "lr"):
            assert r[key] == g[key], key
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(v, base_state_dict(b.model)[k]) for k, v in base_state_dict(a.model).items())
    # a checkpoint written without LoRA cannot resume a LoRA run
    from k3rl.config import LearnerSection
    from k3rl.learner.trainer import Trainer

    Trainer(build_model("k3-tiny"), LearnerSection(micro_batch_tokens=64)).save_checkpoint(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="has no adapter/"):
        lora_trainer().load_checkpoint(tmp_path / "plain")
