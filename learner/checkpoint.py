"""Trainer checkpoints: everything needed for the step after a resume to equal the step
without one, bit for bit.

    <dir>/model/                 config.json + safetensors shards + index (official HF layout, save_hf)
    <dir>/adapter/               with LoRA: adapter_config.json + adapter_model.safetensors (PEFT layout;
                                 model/ then holds the base weights the adapters are added to)
    <dir>/reference/             the frozen reference policy of the KL term, same layout (when KL is on)
    <dir>/optimizer-rank{r}.pt   optimizer state (each rank's shard under FSDP, as local tensors)
    <dir>/qb-rank{r}.pt          Quantile Balancing histograms accumulated on the rank (the bias is in model/)
    <dir>/rng-rank{r}.pt         torch CPU / CUDA, Python and NumPy generator states
    <dir>/trainer.json           step counters, data position, the caller's data cursor, world size

Weights are written in their own dtype (fp32 master weights stay fp32), so save -> load
is exact. Under FSDP, save and load are collective (every rank calls them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from k3rl.model import build_model, load_state_into, save_hf
from k3rl.model.lora import base_state_dict, load_peft_adapter, save_peft_adapter

from .distributed import is_distributed, load_full_state_dict

FORMAT = 1


def _barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _optimizer_state_local(optimizer) -> dict:
    """Optimizer state with DTensors replaced by their local shards (plain tensors pickle safely)."""
    sd = optimizer.state_dict()
    state = {
        idx: {k: (v.to_local() if _is_dtensor(v) else v) for k, v in s.items()} for idx, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def _optimizer_state_global(optimizer, sd: dict) -> dict:
    """Wrap local shards back into DTensors placed like their parameters."""
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs hold DTensors
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, s in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if _is_dtensor(p) and isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in s.items()
        }  # fmt: skip
    return {"state": state, "param_groups": sd["param_groups"]}


def _unsharded_model_for_saving(trainer, state: dict[str, torch.Tensor]):
    """A plain K3ForCausalLM holding `state` (tensors assigned as they are, dtypes kept)."""
    model = build_model(trainer.model_config, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    return model


def _lora_base_state(trainer) -> dict[str, torch.Tensor]:
    """The adapted model's own weights under a plain model's names (views: loading into them loads them)."""
    return base_state_dict(trainer.model)


def _load_reference(trainer, path: Path) -> None:
    """The saved reference policy; a checkpoint written without KL has none, and then the
    reference becomes the loaded policy weights (the policy at the start of this run)."""
    if not path.exists():
        state = trainer.full_state_dict()
        trainer.reference.load_state_dict({k: v.to(trainer.device) for k, v in state.items()}, strict=True)
    elif hasattr(trainer.model_config, "to_hf"):
        load_state_into(trainer.reference, path)
    else:
        trainer.reference.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)


def save(trainer, directory) -> Path:
    d = Path(directory)
    rank = trainer.rank
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
    _barrier()
    # 1. model in the official layout
    if trainer.model_config is not None and hasattr(trainer.model_config, "to_hf"):
        # experts as the model holds them (fp32 master weights stay fp32), whatever the starting
        # checkpoint stored: a resume must continue from these exact values
        if trainer.sharded:
            state = trainer.full_state_dict()  # collective
            if rank == 0:
                save_hf(_unsharded_model_for_saving(trainer, state), d / "model", experts="dense")
        elif trainer.lora is not None:  # LoRA is single-rank (config refuses FSDP)
            save_hf(_unsharded_model_for_saving(trainer, _lora_base_state(trainer)), d / "model", experts="dense")
            save_peft_adapter(trainer.model, d / "adapter", trainer.lora.settings())
        elif rank == 0:
            save_hf(trainer.model, d / "model", experts="dense")
    else:
        state = trainer.full_state_dict()
        if rank == 0:
            (d / "model").mkdir(exist_ok=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(d / "model" / "model.safetensors"))
    if trainer.reference is not None and rank == 0:
        if hasattr(trainer.model_config, "to_hf"):
            save_hf(trainer.reference, d / "reference", experts="dense")
        else:
            (d / "reference").mkdir(exist_ok=True)
            ref_state = {k: v.detach().cpu().contiguous() for k, v in trainer.reference.state_dict().items()}
            save_file(ref_state, str(d / "reference" / "model.safetensors"))
    # 2. per-rank pieces
    torch.save(_optimizer_state_local(trainer.optimizer), d / f"optimizer-rank{rank}.pt")
    qb = []
    if hasattr(trainer.model, "qb_counts"):
        qb = [(c.detach().cpu().clone(), n.detach().cpu().clone()) for c, n in trainer.model.qb_counts()]
    torch.save({"counts": qb, "frozen": bool(getattr(trainer.model, "qb_frozen", True))}, d / f"qb-rank{rank}.pt")
    torch.save(_rng_state(), d / f"rng-rank{rank}.pt")
    # 3. counters
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": trainer.step,
            "sft_step": trainer.sft_step_count,
            "data_position": trainer.data_position,
            "data_state": trainer.data_state,
            "world_size": trainer.world_size,
            "learner_config": trainer.cfg.model_dump(mode="json") if hasattr(trainer.cfg, "model_dump") else {},
        }
        (d / "trainer.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _barrier()
    return d


def load(trainer, directory) -> None:
    d = Path(directory)
    meta_path = d / "trainer.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{d} is not a trainer checkpoint: trainer.json is missing (written by save_checkpoint)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d}: checkpoint format {meta.get('format')} is not the supported format {FORMAT}")
    if meta["world_size"] != trainer.world_size:
        raise ValueError(
            f"{d} was saved by {meta['world_size']} ranks but this trainer has {trainer.world_size}; "
            "the optimizer shards need the same world size"
        )
    rank = trainer.rank
    # 1. model
    if trainer.model_config is not None and hasattr(trainer.model_config, "to_hf"):
        if trainer.sharded:
            state = trainer.full_state_dict()  # collective: the whole model on every rank, streamed into
            load_state_into(state, d / "model")
            load_full_state_dict(trainer.model, state)
        elif trainer.lora is not None:
            if not (d / "adapter" / "adapter_model.safetensors").exists():
                raise FileNotFoundError(f"{d} has no adapter/ (PEFT adapters): it was not written with learner.lora; "
                                        "resume it without learner.lora, or start a new run")
            load_state_into(_lora_base_state(trainer), d / "model")  # views of the frozen weights
            load_peft_adapter(trainer.model, d / "adapter")
        else:
            load_state_into(trainer.model, d / "model")
    else:
        state = load_file(str(d / "model" / "model.safetensors"))
        if trainer.sharded:
            load_full_state_dict(trainer.model, state)
        else:
            trainer.model.load_state_dict(state, strict=True)
    if trainer.reference is not None:
        _load_reference(trainer, d / "reference")
    # 2. optimizer, QB, RNG
    opt_sd = torch.load(d / f"optimizer-rank{rank}.pt", map_location=trainer.device, weights_only=True)
    if trainer.sharded:
        opt_sd = _optimizer_state_global(trainer.optimizer, opt_sd)
    trainer.optimizer.load_state_dict(opt_sd)
    qb = torch.load(d / f"qb-rank{rank}.pt", weights_only=True)
    if hasattr(trainer.model, "qb_counts"):
        with torch.no_grad():
            for (c, n), (c_saved, n_saved) in zip(trainer.model.qb_counts(), qb["counts"], strict=True):
                c.copy_(c_saved)
                n.copy_(n_saved)
    _set_rng_state(torch.load(d / f"rng-rank{rank}.pt", weights_only=False))
    # 3. counters
    trainer.step = meta["step"]
    trainer.sft_step_count = meta["sft_step"]
    trainer.data_position = dict(meta["data_position"])
    trainer.data_state = meta["data_state"]
    _barrier()
