"""The release's layout (docs/model.md §12): its names for the full preset, and a small checkpoint in
that layout, written here from the format's description (not by k3rl's writer), that the loader,
the embedded engine and the learner start from; saving it back gives the same bytes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from k3_model_helpers import make_tiny
from safetensors.torch import save_file

from k3rl.model import K3ForCausalLM, build_model, load_hf, save_hf
from k3rl.model.checkpoint import (
    CheckpointMismatchError,
    StoredTensor,
    load_state_into,
    match_checkpoint,
    read_hf_tensors,
)
from k3rl.model.state_dict_adapter import hf_layout

RELEASE_QUANTIZATION = {  # the release's text_config.quantization_config (compressed-tensors)
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group",
                                              "symmetric": True, "scale_dtype": "torch.uint8", "observer": "minmax"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


# ----- the full preset: 497,220 names ------------------------------------------------------------------


@pytest.mark.slow  # seconds each: make test runs it, make test-fast leaves it out
def test_the_full_preset_lists_the_releases_497220_names():
    state = build_model("k3", device="meta").state_dict()
    layout = hf_layout(state, experts="mxfp4")
    assert len(layout) == 497_220
    expert = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\."
                        r"(weight_packed|weight_scale)$")
    hits = [expert.match(n) for n in layout]
    assert sum(h is not None for h in hits) == 92 * 896 * 3 * 2
    assert {int(h[1]) for h in hits if h} == set(range(1, 93)) and {int(h[2]) for h in hits if h} == set(range(896))
    others = [n for n, h in zip(layout, hits, strict=True) if h is None]
    assert len(others) == 2_628
    assert all(n.startswith(("language_model.model.", "language_model.lm_head.", "vision_tower.", "mm_projector."))
               for n in others)
    assert sum(n.startswith(("vision_tower.", "mm_projector.")) for n in others) == 168
    moe = [n for n in others if ".block_sparse_moe." in n]
    assert {n.split(".block_sparse_moe.")[1] for n in moe} == {
        "gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight", "shared_experts.down_proj.weight", "routed_expert_down_proj.weight",
        "routed_expert_up_proj.weight", "routed_expert_norm.weight"}
    assert len(moe) == 92 * 8 and not any(".layers.0.block_sparse_moe." in n for n in moe)
    assert [n for n in others if ".mlp." in n and n.startswith("language_model.")] == [f"language_model.model.layers.0.mlp.{p}_proj.weight"
                                                    for p in ("gate", "up", "down")]
    # shapes and dtypes as the release's headers give them
    w1 = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    w2 = "language_model.model.layers.92.block_sparse_moe.experts.895.w2"
    assert layout[f"{w1}.weight_packed"] == ((3072, 1792), torch.uint8)
    assert layout[f"{w1}.weight_scale"] == ((3072, 112), torch.uint8)
    assert layout[f"{w2}.weight_packed"] == ((3584, 1536), torch.uint8)
    assert layout[f"{w2}.weight_scale"] == ((3584, 96), torch.uint8)
    assert layout["language_model.model.layers.0.self_attn.A_log"][0] == (128,)
    # and the loader resolves every one of them to the model (headers only: nothing is allocated)
    stored = {n: StoredTensor("x.safetensors", dt, shape, 0) for n, (shape, dt) in layout.items()}
    targets = match_checkpoint(stored, state)
    assert len(targets) == 497_220 and {t.key for t in targets.values()} == set(state)


# ----- a small checkpoint in the release's layout ---------------------------------------------------------

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 from the format's description, in numpy: per 32 values the block max rounded to a
    power of two (1.75 and above rounds up) gives the exponent e = log2 - 2; each value / 2^e goes
    to the nearest E2M1 magnitude (ties to the even code), sign in bit 3, two codes per byte."""
    x = w.float().numpy().reshape(w.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(x).max(-1)
    e = np.floor(np.log2(amax))
    e = e + (amax / 2.0**e >= 1.75) - 2
    y = np.abs(x) / 2.0 ** e[..., None]
    dist = np.abs(y[..., None] - E2M1) + 1e-9 * (np.arange(8) % 2)  # a tie goes to the even code
    codes = dist.argmin(-1) + 8 * np.signbit(x)
    codes = codes.reshape(w.shape[0], -1).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.from_numpy(packed), torch.from_numpy((e + 127).astype(np.uint8))


def reference_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    codes = np.stack([packed.numpy() & 15, packed.numpy() >> 4], -1).reshape(packed.shape[0], -1)
    values = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return torch.from_numpy(values.reshape(*scale.shape, 32) * 2.0 ** (scale.numpy().astype(np.float64) - 127)[..., None]
                            ).reshape(packed.shape[0], -1).float()


def release_name(key: str, first_moe_layer: int) -> str:
    """Our key -> the release's name, spelled from the format (layers >= first_k_dense_replace are MoE)."""
    if key.startswith(("vision_tower.", "mm_projector.")):
        return key
    m = re.match(r"model\.layers\.(\d+)\.mlp\.(.*)", key)
    if m and int(m[1]) >= first_moe_layer:
        key = f"model.layers.{m[1]}.block_sparse_moe.{m[2]}"
    return "language_model." + key


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(source model (bf16), the same with its experts as MXFP4 gives them back, checkpoint dir, tensors)."""
    source = make_tiny(seed=21).to_param_dtype(torch.bfloat16)
    config = source.config
    tensors, dequantised = {}, {}
    for key, t in source.state_dict().items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(w[123])$", key)
        if m:
            rows = []
            for e in range(t.shape[0]):
                name = release_name(f"{m[1]}.{e}.{m[2]}", config.first_k_dense_replace)
                packed, scale = reference_mxfp4(t[e])
                tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"] = packed, scale
                rows.append(reference_dequant(packed, scale))
            dequantised[key] = torch.stack(rows)
        elif key.endswith(".self_attn.A_log"):
            tensors[release_name(key, 1)] = torch.cat([t, t.new_zeros(128 - t.shape[0])])
        else:
            tensors[release_name(key, 1)] = t.contiguous()
    path = tmp_path_factory.mktemp("release")
    names = sorted(tensors)
    # three shards; the last expert's weight_packed and weight_scale end up in different ones
    cut = names.index("language_model.model.layers.7.block_sparse_moe.experts.7.w3.weight_scale")
    shards = {"model-00001-of-00003.safetensors": names[: len(names) // 2],
              "model-00002-of-00003.safetensors": names[len(names) // 2: cut],
              "model-00003-of-00003.safetensors": names[cut:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / fname))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = config.to_hf_dict()
    raw["text_config"]["quantization_config"] = RELEASE_QUANTIZATION
    for switch in ("qb_num_bins", "qb_frozen", "gradient_checkpointing", "kernel_backend"):
        del raw["text_config"][switch]  # not in the release's config
    (path / "config.json").write_text(json.dumps(raw))
    quantised = make_tiny(seed=21).to_param_dtype(torch.bfloat16)
    with torch.no_grad():
        for key, value in dequantised.items():
            quantised.get_parameter(key).copy_(value)
    return source, quantised, path, tensors


def test_the_release_layout_loads_and_gives_the_logits_of_its_model(release):
    source, quantised, path, _ = release
    loaded = load_hf(path)
    assert loaded.routed_experts_format == "mxfp4"
    assert next(loaded.parameters()).dtype == torch.bfloat16  # the checkpoint's dtype
    for key, value in quantised.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.tensor([[(7 * i + 3) % 250 for i in range(24)]])
    with torch.no_grad():
        got, want, original = loaded(ids).float(), quantised(ids).float(), source(ids).float()
    assert torch.equal(got, want)
    # against the model it came from: the same but for MXFP4 rounding of the experts, each value within
    # its block's rounding bound (half the widest E2M1 gap, 2^e <= block max / 3.5)
    assert not torch.equal(got, original)
    for key, value in source.state_dict().items():
        if ".experts." not in key:
            assert torch.equal(loaded.state_dict()[key], value), key
            continue
        blocks = value.float().reshape(*value.shape[:-1], -1, 32)
        err = (loaded.state_dict()[key].float().reshape(blocks.shape) - blocks).abs()
        assert bool((err <= blocks.abs().amax(-1, keepdim=True) / 3.5).all()), key
        assert (err.norm() / blocks.norm()).item() < 0.15, key


def test_saving_it_back_writes_the_same_tensors_and_the_quantization_section(release, tmp_path):
    _, _, path, tensors = release
    save_hf(load_hf(path), tmp_path / "again", max_shard_bytes=200_000)  # experts as they came: MXFP4
    again = read_hf_tensors(tmp_path / "again")
    assert again.keys() == tensors.keys()
    for name, t in tensors.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name
    text = json.loads((tmp_path / "again" / "config.json").read_text())["text_config"]
    q = text["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "mxfp4-pack-quantized")
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    # bf16 experts remain an option (our own presets save that way by default)
    save_hf(load_hf(path), tmp_path / "dense", experts="dense")
    dense = read_hf_tensors(tmp_path / "dense")
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in dense
    assert not any(n.endswith(("weight_packed", "weight_scale")) for n in dense)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())["text_config"]


def test_the_embedded_engine_and_the_learner_start_from_it(release, tmp_path):
    from k3rl.config import JobConfig
    from k3rl.learner.trainer import Trainer
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.types import SamplingParams

    _, quantised, path, _ = release
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = [(5 * i + 1) % 250 + 1 for i in range(11)]
    engine = EmbeddedEngine.from_preset("k3-tiny", checkpoint=str(path), dtype="bfloat16", background=False)
    assert engine.generate(prompt, greedy).token_ids == EmbeddedEngine(quantised, background=False).generate(
        prompt, greedy).token_ids
    job = JobConfig.load(None, [f"model.checkpoint={path}", "learner.lr=0.05"])
    trainer = Trainer.from_job(job)
    experts = "model.layers.1.mlp.experts.w2"
    assert trainer.model.routed_experts_format == "mxfp4"
    assert torch.equal(trainer.model.state_dict()[experts], quantised.state_dict()[experts].float())  # fp32 master
    # the weight sync sends what the engines hold: MXFP4 experts
    update = trainer.export_weights(1, dtype=torch.bfloat16)
    names = update.names
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed" in names
    assert not any(n.endswith("w2.weight") for n in names)
    assert update.nbytes < trainer.export_weights(1, dtype=torch.bfloat16, experts="dense").nbytes
    engine.update_weights(update)
    assert torch.equal(engine.model.state_dict()[experts], quantised.state_dict()[experts])
    # after a step the learner's experts leave the MXFP4 grid; the engines get them quantised again
    from k3rl.types import Trajectory

    batch = [Trajectory(env_id="test/Synthetic-v0", group_id="g", prompt_ids=prompt, completion_ids=[7 + i, 9, 11],
                        logprobs=[-5.0] * 3, loss_mask=[1] * 3, versions=[1] * 3, reward=float(i)) for i in range(4)]
    trainer.train_step(batch)
    engine.update_weights(trainer.export_weights(2, dtype=torch.bfloat16))
    master = trainer.model.state_dict()[experts]
    held = engine.model.state_dict()[experts]
    assert not torch.equal(held.float(), master)
    from k3rl.model import mxfp4

    assert torch.equal(held, mxfp4.dequantize(*mxfp4.quantize(master), torch.bfloat16))
    # the trainer's own checkpoints keep the fp32 master experts, so a resume continues exactly
    trainer.save_checkpoint(tmp_path / "step-1")
    saved = read_hf_tensors(tmp_path / "step-1" / "model")
    w2 = saved["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight"]
    assert w2.dtype == torch.float32 and torch.equal(w2, master[0])
    resumed = Trainer.from_job(job)
    resumed.load_checkpoint(tmp_path / "step-1")
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(),
                                                 trainer.model.state_dict().values(), strict=True))


def test_a_broken_release_layout_is_refused_by_name(release, tmp_path):
    _, _, path, tensors = release
    bad = dict(tensors)
    del bad["language_model.model.layers.2.block_sparse_moe.experts.5.w1.weight_scale"]
    bad["language_model.model.layers.3.block_sparse_moe.experts.0.w3.weight_packed"] = torch.zeros(64, 16, dtype=torch.uint8)
    bad["language_model.model.layers.1.mlp.gate.weight"] = bad.pop("language_model.model.layers.1.block_sparse_moe.gate.weight")
    (tmp_path / "bad").mkdir()
    save_file(bad, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf(tmp_path / "bad")
    msg = str(err.value)
    assert "experts.5.w1.weight_scale" in msg and "missing (2)" in msg  # and the renamed gate below
    assert "unexpected (1): language_model.model.layers.1.mlp.gate.weight" in msg  # MoE layers are block_sparse_moe
    assert "experts.0.w3.weight_packed: checkpoint (64, 16) vs model (64, 32)" in msg
    int4 = json.loads((path / "config.json").read_text())
    int4["text_config"]["quantization_config"] = {**RELEASE_QUANTIZATION, "format": "pack-quantized"}
    (tmp_path / "bad" / "config.json").write_text(json.dumps(int4))
    model = K3ForCausalLM(build_model("k3-tiny", device="meta").config)
    with pytest.raises(ValueError, match="'pack-quantized' is not one k3rl reads"):
        load_state_into(model, tmp_path / "bad")


def test_the_load_plan_gives_each_rank_its_experts_and_its_rows(release):
    from k3rl.model import plan_loading
    from k3rl.model.checkpoint import stored_tensors
    from k3rl.model.load_plan import expert_parallel_size

    _, quantised, path, tensors = release
    stored = stored_tensors(path)
    state = quantised.state_dict()
    experts = {n: s for n, s in stored.items() if ".experts." in n}
    dense_bytes = sum(s.nbytes for n, s in stored.items() if n not in experts)
    plans = plan_loading(stored, state, world_size=4, expert_parallel=2)
    assert [p.experts for p in plans] == [range(0, 4), range(4, 8), range(0, 4), range(4, 8)]  # [W/ep, ep] grid
    for p in plans:
        mine = [n for n in experts if int(n.split(".experts.")[1].split(".")[0]) in p.experts]
        assert p.expert_read_bytes == sum(experts[n].nbytes for n in mine)
        assert {experts[n].file for n in mine} <= set(p.shards)
    assert sum(p.read_bytes - p.expert_read_bytes for p in plans) == dense_bytes  # FSDP rows partition the rest
    assert sum(p.expert_read_bytes for p in plans[:2]) == sum(s.nbytes for s in experts.values())
    assert plans[0].shards == sorted({s.file for s in stored.values()})  # rank 0 has rows of everything here
    assert expert_parallel_size(896, 256) == 128 and expert_parallel_size(896, 64) == 64
    with pytest.raises(ValueError, match="must divide"):
        plan_loading(stored, state, world_size=4, expert_parallel=3)
