"""LoRA on k3-tiny: only the adapters train, the merge is W + s * B @ A, the adapters alone are small, PEFT layout."""

import json

import pytest
import torch

from k3rl.learner.lora import (
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
from k3rl.learner.model import build_model

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


def test_peft_reads_the_adapter(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    model, _ = adapted()
    save_peft_adapter(model, tmp_path, SETTINGS, base_model="k3-tiny")
    weights = peft.utils.load_peft_weights(str(tmp_path))
    assert set(weights) == set(adapter_state_dict(model))
    config = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert (config.r, config.lora_alpha, config.peft_type) == (4, 8, peft.PeftType.LORA)
    assert "language_model.model.layers.0.self_attn.q_proj" in config.target_modules
