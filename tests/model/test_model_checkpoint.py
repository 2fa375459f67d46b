"""Checkpoints in the official Kimi-K3 HF layout: names, shards, index, bit-exact round trip, errors."""

from __future__ import annotations

import json

import pytest
import torch
from k3_model_helpers import make_tiny
from safetensors import safe_open
from safetensors.torch import save_file

from k3rl.model import K3Config, load_hf, load_state_into, save_hf
from k3rl.model.checkpoint import CheckpointMismatchError, read_hf_tensors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_tiny(seed=7).to_param_dtype(torch.bfloat16)
    path = tmp_path_factory.mktemp("ckpt")
    save_hf(model, path, max_shard_bytes=400_000)
    return model, path


def test_layout_and_official_names(saved):
    model, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((path / s).exists() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = read_hf_tensors(path)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    c = model.config
    E = c.num_experts
    L, M = "language_model.model.", "language_model.model.layers.1.block_sparse_moe."
    for name in [
        f"{L}embed_tokens.weight", "language_model.lm_head.weight", f"{L}norm.weight",
        f"{L}output_attn_res_proj.weight", f"{L}output_attn_res_norm.weight",
        f"{L}layers.0.self_attn.q_proj.weight", f"{L}layers.0.self_attn.q_conv1d.weight",
        f"{L}layers.0.self_attn.f_a_proj.weight", f"{L}layers.0.self_attn.o_norm.weight",
        f"{L}layers.0.mlp.gate_proj.weight", f"{L}layers.0.self_attention_res_proj.weight",
        f"{L}layers.0.mlp_res_norm.weight", f"{L}layers.3.self_attn.kv_a_proj_with_mqa.weight",
        f"{L}layers.3.self_attn.q_a_layernorm.weight", f"{L}layers.3.self_attn.kv_b_proj.weight",
        f"{M}gate.weight", f"{M}gate.e_score_correction_bias",
        f"{M}experts.{E - 1}.w2.weight", f"{M}routed_expert_down_proj.weight",
        f"{M}routed_expert_norm.weight", f"{M}shared_experts.down_proj.weight",
        "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.1.wqkv.weight", "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight",
    ]:
        assert name in tensors, name
    assert tensors[f"{M}experts.0.w1.weight"].shape == (c.moe_intermediate_size, c.routed_expert_hidden_size)
    a_log = tensors[f"{L}layers.0.self_attn.A_log"]
    H = c.linear_attn_config.num_heads
    assert a_log.shape == (128,) and a_log.dtype == torch.float32 and bool((a_log[H:] == 0).all())
    assert tensors[f"{L}layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert tensors[f"{M}gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors[f"{L}layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert not any(".experts.w1" in n for n in tensors)  # no stacked names leak out
    assert not any(n.startswith(("model.", "lm_head.")) for n in tensors)  # the text model is under language_model.
    assert not any(".mlp.gate." in n or ".mlp.experts." in n for n in tensors)  # MoE layers are block_sparse_moe.
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config["text_config"]  # dense experts: nothing is quantised
    assert K3Config.from_hf(path) == model.config


def test_round_trip_is_bit_exact(saved):
    model, path = saved
    loaded = load_hf(path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def _rewrite(src, dst, edit):
    tensors = read_hf_tensors(src)
    edit(tensors)
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def test_mismatches_are_reported_by_name(saved, tmp_path):
    model, path = saved

    def edit(t):
        del t["language_model.model.layers.2.self_attn.g_proj.weight"]
        del t["language_model.model.layers.1.block_sparse_moe.experts.3.w3.weight"]
        t["language_model.model.layers.0.extra.weight"] = torch.zeros(2)
        t["language_model.model.norm.weight"] = torch.zeros(5, dtype=torch.bfloat16)

    bad = _rewrite(path, tmp_path / "bad", edit)
    target = make_tiny(seed=8).to_param_dtype(torch.bfloat16)
    with pytest.raises(CheckpointMismatchError) as err:
        load_state_into(target, bad)
    msg = str(err.value)
    assert "missing (2)" in msg and "language_model.model.layers.2.self_attn.g_proj.weight" in msg
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w3.weight" in msg
    assert "unexpected (1): language_model.model.layers.0.extra.weight" in msg
    assert "language_model.model.norm.weight: checkpoint (5,) vs model (128,)" in msg


def test_single_file_checkpoint_loads(saved, tmp_path):
    model, path = saved
    single = _rewrite(path, tmp_path / "single", lambda t: None)
    target = make_tiny(seed=9).to_param_dtype(torch.bfloat16)
    load_state_into(target, single)
    assert torch.equal(target.model.layers[1].mlp.experts.w2, model.model.layers[1].mlp.experts.w2)
    with safe_open(str(single / "model.safetensors"), framework="pt") as f:
        assert "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight" in f.keys()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json or model.safetensors"):
        load_state_into(target, tmp_path)


def test_partial_expert_update_keeps_the_other_experts():
    from k3rl.model.state_dict_adapter import from_hf, to_hf

    model = make_tiny(seed=10)
    expected = model.state_dict()
    new0 = torch.randn(model.config.moe_intermediate_size, model.config.routed_expert_hidden_size)
    update = {"language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight": new0}
    state, unexpected = from_hf(update, expected)
    assert unexpected == []
    stacked = state["model.layers.1.mlp.experts.w1"]
    assert torch.equal(stacked[0], new0) and torch.equal(stacked[1:], expected["model.layers.1.mlp.experts.w1"][1:])
    strict, _ = from_hf(update, expected, fill_missing_experts=False)
    assert "model.layers.1.mlp.experts.w1" not in strict
    full = to_hf(expected)  # and a full round trip through the official names is the identity
    back, unexpected = from_hf(full, expected, fill_missing_experts=False)
    assert unexpected == [] and back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_checkpoints_with_the_previous_k3rl_names_still_load(saved, tmp_path):
    """Before the release's names, k3rl wrote `model.*` / `lm_head.weight` with `mlp.` for every layer."""
    model, path = saved

    def rename(t):
        for name in list(t):
            old = name.removeprefix("language_model.").replace(".block_sparse_moe.", ".mlp.")
            t[old] = t.pop(name)

    old = _rewrite(path, tmp_path / "old", rename)
    with safe_open(str(old / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.experts.0.w2.weight" in f.keys() and "lm_head.weight" in f.keys()
    loaded = load_hf(old)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True))

    def both(t):  # one tensor under its old and its new name: refused, not silently picked
        t["model.norm.weight"] = t["language_model.model.norm.weight"].clone()

    with pytest.raises(CheckpointMismatchError, match="the same tensor as"):
        load_state_into(make_tiny(seed=9).to_param_dtype(torch.bfloat16), _rewrite(path, tmp_path / "both", both))


def test_a_checkpoint_of_another_architecture_is_refused_by_field(saved):
    from k3rl.model import build_model

    _, path = saved
    with pytest.raises(CheckpointMismatchError, match=r"(?s)mis-shaped.*hidden_size \(checkpoint 128, model 768\).*model.preset"):
        build_model("k3-small", checkpoint=path)
    with pytest.raises(ValueError, match=r"rms_norm_eps \(checkpoint 1e-05, model 1e-06\)"):  # same shapes, other maths
        build_model("k3-tiny", {"rms_norm_eps": 1e-6}, checkpoint=path)
    build_model("k3-tiny", {"kernel_backend": "torch", "qb_num_bins": 10}, checkpoint=path)  # run-time switches may differ
