"""Per-Head Muon (docs/model.md §8) with AdamW for the parameters Muon does not own.

Muon, for a matrix parameter W with gradient G (K2 / Moonlight recipe, §8.1):
    M <- mu M + G                                  momentum, mu = 0.95
    U  = G + mu M                                  Nesterov input
    O  = NS5(U)                                    Newton-Schulz orthogonalisation
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(r, c)) * O     0.2 sqrt(max) matches AdamW's update RMS

Per-Head Muon (§8.2) runs NS5 on blocks instead of whole matrices:
    KDA  q_proj / k_proj / v_proj [H*D, d]          -> H blocks [D, d]
    MLA  q_b_proj [H*(dn+dr), q_rank]               -> H blocks [dn+dr, q_rank]
         kv_b_proj [H*(dn+dv), kv_rank]             -> H blocks [dn+dv, kv_rank]
    MoE  stacked experts w1/w3 [E, f, l], w2 [E, l, f] -> E blocks
    every other 2-D weight                           -> one block (the whole matrix)
and the update scale 0.2 sqrt(max(rows, cols)) uses the block's shape. Blocks of the same
shape, from every parameter of the step, are stacked and orthogonalised by one batched
`newton_schulz` call: no Python loop over heads or experts.

AdamW (betas 0.9 / 0.95, eps 1e-8, decoupled weight decay, same lr) takes the embedding,
lm_head, norms, biases, vectors, A_log, dt_bias, convolution weights and the AttnRes
pseudo-queries. `e_score_correction_bias` belongs to no group: Quantile Balancing sets it.

Weight decay pulls a weight towards 0, which is right for the matrices that map one space
to another and wrong for the parameters whose 0 means something else: norm gains (1 = no
scaling), biases, the gate's A_log and dt_bias (the decay rates), the AttnRes pseudo-queries
and the token embeddings (rows trained only when their token occurs). Those go to groups with
weight_decay 0 (`decays`); the summary says which.

Parameters may be FSDP2 DTensors: element-wise state stays sharded like the parameter;
the Muon input is gathered (`full_tensor`), each rank orthogonalises 1/W of the stacked
blocks, one all-gather shares the results, and each rank keeps the slice of its shard.
Plain tensors under FSDP (the rank-local expert slices of expert parallelism) are
orthogonalised by their own rank: per-expert blocks need nothing from the other ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from k3rl.kernels.newton_schulz import newton_schulz

__all__ = [
    "PerHeadMuon",
    "ParamGroupSummary",
    "newton_schulz",
    "param_groups",
    "head_block_rows",
    "muon_update_scale",
    "QKClip",
]

import torch.distributed as dist

from .qk_clip import QKClip  # noqa: E402  (re-exported: the MLA weight clip that goes with Muon)

NO_GROUP_SUFFIXES = ("e_score_correction_bias",)
# AdamW by name: substrings of the parameter name (K3 / HF naming).
ADAMW_NAME_PARTS = ("embed", "lm_head", "conv", "A_log", "dt_bias", "norm", "res_proj", "pos_emb", "bias")


def head_block_rows(config) -> dict[str, int]:
    """Rows of one head's block for the per-head projections of a K3Config (module name -> rows)."""
    D = config.linear_attn_config.head_dim
    return {
        "q_proj": D,  # KDA [H*D, d]
        "k_proj": D,
        "v_proj": D,
        "q_b_proj": config.qk_nope_head_dim + config.qk_rope_head_dim,  # MLA [H*(dn+dr), q_rank]
        "kv_b_proj": config.qk_nope_head_dim + config.v_head_dim,  # MLA [H*(dn+dv), kv_rank]
    }


def muon_update_scale(rows: int, cols: int) -> float:
    """0.2 sqrt(max(rows, cols)): the RMS of an orthogonal [rows, cols] block times this is
    about 0.2, AdamW's typical update RMS (Moonlight)."""
    return 0.2 * math.sqrt(max(rows, cols))


@dataclass
class ParamGroupSummary:
    """What `param_groups` decided, one row per parameter: (name, shape, group, reason)."""

    rows: list[tuple[str, tuple[int, ...], str, str]]

    def counts(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for _, shape, group, _ in self.rows:
            out[group][0] += 1
            out[group][1] += math.prod(shape)
        return {k: (v[0], v[1]) for k, v in out.items()}

    def group_of(self, name: str) -> str:
        for n, _, g, _ in self.rows:
            if n == name:
                return g
        raise KeyError(f"no parameter named {name!r} in the summary")

    def __str__(self) -> str:
        lines = [f"{'group':<22} {'tensors':>8} {'parameters':>14}"]
        for g, (n, p) in sorted(self.counts().items()):
            lines.append(f"{g:<22} {n:>8} {p:>14,}")
        lines.append("")
        width = max((len(n) for n, *_ in self.rows), default=10)
        for name, shape, group, why in self.rows:
            lines.append(f"{name:<{width}}  {str(list(shape)):<18} {group:<22} {why}")
        return "\n".join(lines)


ADAMW_MODULE_TYPES = (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
NO_DECAY_NAME_PARTS = ("embed", "norm", "A_log", "dt_bias", "bias")


def decays(name: str, p: nn.Parameter, owner: nn.Module | None = None) -> bool:
    """Whether weight decay applies: not to vectors (norm gains, biases, A_log, dt_bias, AttnRes
    queries), embeddings, or anything named like them; to every other matrix (lm_head included)."""
    if p.dim() < 2 or isinstance(owner, nn.Embedding):
        return False
    return not any(part in name for part in NO_DECAY_NAME_PARTS)


def _classify(name: str, p: nn.Parameter, head_rows: dict[str, int], owner: nn.Module | None = None) -> tuple[str, int | None, str]:
    """-> (group, block_rows, reason). group is 'muon', 'adamw' or 'none'."""
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith(NO_GROUP_SUFFIXES):
        return "none", None, "set by Quantile Balancing, not by gradients"
    if not p.requires_grad:
        return "none", None, "requires_grad is False"
    if isinstance(owner, ADAMW_MODULE_TYPES):
        return "adamw", None, f"weight of an {type(owner).__name__}"
    if p.dim() < 2:
        return "adamw", None, "vector (norm / bias / gate vector)"
    if min(p.shape[-2:]) == 1 and p.dim() == 2:
        return "adamw", None, "[1, d] or [d, 1] vector"
    for part in ADAMW_NAME_PARTS:
        if part in name:
            return "adamw", None, f"name contains {part!r}"
    if p.dim() == 3 and "experts" in name:
        return "muon", None, f"per expert: {p.shape[0]} blocks of {list(p.shape[1:])}"
    if p.dim() != 2:
        return "adamw", None, f"{p.dim()}-D tensor that is not a stacked expert weight"
    rows = head_rows.get(module)
    if rows is not None and name.endswith(module + ".weight"):
        if p.shape[0] % rows:
            raise ValueError(
                f"param_groups: {name} has {p.shape[0]} rows, not a multiple of the head block of {rows} rows; "
                "pass head_rows that match the model"
            )
        return "muon", rows, f"per head: {p.shape[0] // rows} blocks of [{rows}, {p.shape[1]}]"
    return "muon", None, "whole matrix"


def param_groups(
    model: nn.Module,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    head_rows: dict[str, int] | None = None,
) -> tuple[list[dict], ParamGroupSummary]:
    """Split `model`'s parameters into optimizer groups for `PerHeadMuon`.

    `head_rows` maps a module name (the part before `.weight`) to the rows of one head's
    block; by default it is read from `model.config` (a K3Config) when there is one.
    Returns (groups, summary); `print(summary)` shows every decision.
    """
    if head_rows is None:
        cfg = getattr(model, "config", None)
        head_rows = head_block_rows(cfg) if cfg is not None and hasattr(cfg, "linear_attn_config") else {}
    buckets: dict[tuple[str, int | None, bool], list[tuple[str, nn.Parameter]]] = defaultdict(list)
    rows = []
    owners = {}
    for mod_name, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owners[f"{mod_name}.{pname}" if mod_name else pname] = mod
    for name, p in model.named_parameters():
        group, block, why = _classify(name, p, head_rows, owners.get(name))
        label = group if group != "muon" else ("muon_per_head" if block else ("muon_per_expert" if p.dim() == 3 else "muon_whole"))
        decay = decays(name, p, owners.get(name))
        rows.append((name, tuple(p.shape), label, why if decay or group == "none" else f"{why}; no weight decay"))
        if group != "none":
            buckets[(group, block, decay)].append((name, p))
    groups = []
    for (kind, block, decay), items in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        groups.append(
            {
                "params": [p for _, p in items],
                "names": [n for n, _ in items],
                "kind": kind,
                "block_rows": block,
                "lr": lr,
                "weight_decay": weight_decay if decay else 0.0,
            }
        )
    return groups, ParamGroupSummary(rows)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t


def _like_param(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Slice a full-size update to p's local shard (DTensor) without communication."""
    if not _is_dtensor(p):
        return full
    # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _split_ns_over_ranks(stacked: torch.Tensor, steps: int, backend: str, group) -> torch.Tensor:
    """NS5 of a [N, r, c] stack with the work split over the ranks of `group`: each rank
    orthogonalises N/W blocks (zero blocks pad N to a multiple of W; NS(0) = 0), then one
    all-gather reassembles the stack on every rank."""
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    N = stacked.shape[0]
    per = -(-N // W)
    if per * W != N:
        stacked = torch.cat([stacked, stacked.new_zeros(per * W - N, *stacked.shape[1:])])
    mine = newton_schulz(stacked[rank * per : (rank + 1) * per].contiguous(), steps=steps, backend=backend)
    parts = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts)[:N]


class PerHeadMuon(torch.optim.Optimizer):
    """Per-Head Muon for matrices, AdamW for the rest (see the module docstring).

    Build it from `param_groups(model)`: each group carries `kind` ("muon" / "adamw") and
    `block_rows` (rows of one Muon block; None = whole matrix, or one block per leading
    index of a 3-D expert stack).
    """

    def __init__(
        self,
        params,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        ns_backend: str = "auto",
    ):
        if lr <= 0:
            raise ValueError(f"PerHeadMuon: lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"PerHeadMuon: momentum must lie in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"PerHeadMuon: weight_decay must be >= 0, got {weight_decay}")
        b1, b2 = adamw_betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"PerHeadMuon: adamw_betas must lie in [0, 1), got {adamw_betas}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            betas=adamw_betas, eps=adamw_eps, kind="muon", block_rows=None,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.ns_backend = ns_backend
        for g in self.param_groups:
            if g["kind"] not in ("muon", "adamw"):
                raise ValueError(f"PerHeadMuon: group kind must be 'muon' or 'adamw', got {g['kind']!r}")
            if g["kind"] == "muon":
                for p in g["params"]:
                    if p.dim() < 2:
                        raise ValueError(
                            f"PerHeadMuon: a {p.dim()}-D parameter {tuple(p.shape)} is in a Muon group; "
                            "Muon needs matrices; build the groups with param_groups(model)"
                        )
                    if g["block_rows"] and p.shape[-2] % g["block_rows"]:
                        raise ValueError(
                            f"PerHeadMuon: parameter rows {p.shape[-2]} are not a multiple of block_rows {g['block_rows']}"
                        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step([g for g in self.param_groups if g["kind"] == "muon"])
        for g in self.param_groups:
            if g["kind"] == "adamw":
                self._adamw_step(g)
        return loss

    # -- Muon --------------------------------------------------------------------------
    def _muon_step(self, groups: list[dict]) -> None:
        # 1. momentum + Nesterov input per parameter (one foreach kernel a list, not one a tensor);
        #    cut each into blocks [n, r, c].
        work = []  # (param, group, blocks [n, r, c] full-size)
        for g in groups:
            mu = g["momentum"]
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            grads = [p.grad for p in params]
            if any(_is_dtensor(p) for p in params):  # per tensor: DTensor's foreach coverage varies by version
                for buf, grad in zip(bufs, grads, strict=True):
                    buf.mul_(mu).add_(grad)
                us = [grad.add(buf, alpha=mu) for buf, grad in zip(bufs, grads, strict=True)] if g["nesterov"] else bufs
            else:
                torch._foreach_mul_(bufs, mu)
                torch._foreach_add_(bufs, grads)  # M <- mu M + G
                us = torch._foreach_add(grads, bufs, alpha=mu) if g["nesterov"] else bufs  # U = G + mu M
            for p, u in zip(params, us, strict=True):
                u = _full(u)
                rows = g["block_rows"] or u.shape[-2]
                work.append((p, g, u.reshape(-1, rows, u.shape[-1])))
        # 2. one batched NS5 call per block shape (and step count).
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, (p, g, blocks) in enumerate(work):
            by_shape[(tuple(blocks.shape[1:]), g["ns_steps"], blocks.dtype, _is_dtensor(p))].append(i)
        # Under FSDP every rank holds the same full inputs; the NS work is split between them.
        # Plain tensors beside DTensors are rank-local (expert-parallel slices): each rank
        # orthogonalises its own blocks.
        mesh = next((p.device_mesh for p, _, _ in work if _is_dtensor(p)), None)
        group = mesh.get_group() if mesh is not None and mesh.size() > 1 else None
        ortho: dict[int, torch.Tensor] = {}
        for (_, steps, _, shared), idx in by_shape.items():
            stacked = torch.cat([work[i][2] for i in idx], dim=0)  # [sum n, r, c]
            if group is None or not shared:
                out = newton_schulz(stacked, steps=steps, backend=self.ns_backend)
            else:
                out = _split_ns_over_ranks(stacked, steps, self.ns_backend, group)
            for i, part in zip(idx, out.split([work[i][2].shape[0] for i in idx], dim=0), strict=True):
                ortho[i] = part
        # 3. decoupled weight decay and the scaled update, by foreach over the plain tensors that share
        #    a rate and a scale (a DTensor takes its local slice of the update first).
        batches: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for i, (p, g, blocks) in enumerate(work):
            r, c = blocks.shape[1:]
            update = _like_param(ortho[i].reshape(p.shape), p)  # a DTensor reports its global shape
            if _is_dtensor(p):
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(update, alpha=-g["lr"] * muon_update_scale(r, c))
                continue
            ps, ups = batches[(g["lr"], g["weight_decay"], muon_update_scale(r, c))]
            ps.append(p)
            ups.append(update)
        for (lr, wd, scale), (ps, ups) in batches.items():
            torch._foreach_mul_(ps, 1 - lr * wd)  # W <- W (1 - lr wd)
            torch._foreach_add_(ps, ups, alpha=-lr * scale)  # W <- W - lr 0.2 sqrt(max(r,c)) O

    # -- AdamW -------------------------------------------------------------------------
    def _adamw_step(self, g: dict) -> None:
        b1, b2 = g["betas"]
        by_step: dict[int, list[torch.Tensor]] = defaultdict(list)  # foreach lists share a bias correction
        for p in g["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            by_step[state["step"]].append(p)
        for t, params in by_step.items():
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            ms = [self.state[p]["exp_avg"] for p in params]
            vs = [self.state[p]["exp_avg_sq"] for p in params]
            grads = [p.grad for p in params]
            if any(_is_dtensor(p) for p in params):  # per tensor: DTensor's foreach coverage varies by version
                for p, m, v, grad in zip(params, ms, vs, grads, strict=True):
                    m.lerp_(grad, 1 - b1)
                    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    denom = (v.sqrt() / math.sqrt(bc2)).add_(g["eps"])
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    p.addcdiv_(m, denom, value=-g["lr"] / bc1)
                continue
            torch._foreach_lerp_(ms, grads, 1 - b1)  # m <- b1 m + (1 - b1) g
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)  # v <- b2 v + (1 - b2) g^2
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, g["eps"])  # sqrt(v_hat) + eps
            torch._foreach_mul_(params, 1 - g["lr"] * g["weight_decay"])  # decoupled weight decay
            torch._foreach_addcdiv_(params, ms, denom, value=-g["lr"] / bc1)  # W <- W - lr m_hat / (sqrt(v_hat) + eps)
