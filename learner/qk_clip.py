"""QK-Clip (MuonClip, docs/model.md §8.3) for the Gated MLA layers.

During a step's forward passes, `MaxLogitTracker` records each MLA head's largest
pre-softmax logit S_h = max_{allowed (t, s)} q_h(t) . k_h(s) / sqrt(dn + dr) (causal, per
document). After the optimizer update, every head with S_h > tau gets gamma_h = tau / S_h:
    q_b_proj  q-nope rows of head h   * sqrt(gamma_h)
              q-"rope" rows of head h * gamma_h
    kv_b_proj k-nope rows of head h   * sqrt(gamma_h)        (value rows untouched)
so the head's logits scale by gamma_h; the shared key slice of kv_a_proj_with_mqa is not
touched. KDA layers have no softmax logits (their q and k are L2-normalised).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

__all__ = ["QKClip", "MaxLogitTracker", "mla_max_logits"]


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


class QKClip:
    """The rescaling rule for one MLA layer's weights (see the module docstring)."""

    def __init__(self, nope_dim: int, rope_dim: int, v_dim: int, tau: float = 100.0):
        if tau <= 0:
            raise ValueError(f"QKClip: tau must be > 0, got {tau}")
        self.nope_dim, self.rope_dim, self.v_dim, self.tau = nope_dim, rope_dim, v_dim, tau

    def gamma(self, max_logits: torch.Tensor) -> torch.Tensor:
        """gamma_h = min(1, tau / S_h)."""
        return torch.clamp(self.tau / max_logits.float().clamp_min(1e-30), max=1.0)

    def row_scales(self, max_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row factors for q_b_proj [H (dn+dr)] and kv_b_proj [H (dn+dv)]."""
        g = self.gamma(max_logits)[:, None]
        H = g.shape[0]
        q = torch.cat([g.sqrt().expand(H, self.nope_dim), g.expand(H, self.rope_dim)], dim=1)
        kv = torch.cat([g.sqrt().expand(H, self.nope_dim), torch.ones(H, self.v_dim)], dim=1)
        return q.reshape(-1), kv.reshape(-1)

    @torch.no_grad()
    def apply(self, q_b_proj: torch.Tensor, kv_b_proj: torch.Tensor, max_logits: torch.Tensor) -> torch.Tensor:
        """Rescale the two weights in place (plain tensors or FSDP DTensors); returns gamma [H]."""
        H = max_logits.numel()
        qd, kd = self.nope_dim + self.rope_dim, self.nope_dim + self.v_dim
        if q_b_proj.shape[0] != H * qd or kv_b_proj.shape[0] != H * kd:
            raise ValueError(
                f"QKClip: expected q_b_proj rows {H}*{qd} and kv_b_proj rows {H}*{kd} for {H} heads, "
                f"got {q_b_proj.shape[0]} and {kv_b_proj.shape[0]}"
            )
        for w, scale in zip((q_b_proj, kv_b_proj), self.row_scales(max_logits.cpu()), strict=True):
            scale = scale[:, None].to(dtype=w.dtype)
            if _is_dtensor(w):
                # lazy: torch.distributed.tensor takes ~1 s to import; only FSDP runs need it
                from torch.distributed.tensor import distribute_tensor

                scale = distribute_tensor(scale.to(w.to_local().device), w.device_mesh, w.placements, src_data_rank=None)
            else:
                scale = scale.to(w.device)
            w.mul_(scale)
        return self.gamma(max_logits)


@torch.no_grad()
def mla_max_logits(mla: nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """Per-head max pre-softmax logit [H] of a Gated MLA module on input x [B, T, d]
    (causal; block-diagonal per document with cu_seqlens). Uses the module's own
    `queries` / `latent` pieces; keys as in §3.2: k_h = [k_nope,h ; kx]."""
    B, T, _ = x.shape
    H, dn, dr, dv = mla.num_heads, mla.nope_dim, mla.rope_dim, mla.v_dim
    q = mla.queries(x).float()  # [B, T, H, dn+dr]
    c, kx = mla.latent(x).split([mla.kv_rank, dr], dim=-1)
    k_nope = mla.kv_b_proj(c).reshape(B, T, H, dn + dv)[..., :dn].float()
    k = torch.cat([k_nope, kx.float()[:, :, None].expand(B, T, H, dr)], dim=-1)
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, T]
    best = torch.full((H,), float("-inf"), device=x.device)
    for b in range(B):
        for s0, s1 in zip(bounds[:-1], bounds[1:], strict=True):
            kd = k[b, s0:s1]  # [L, H, D]
            for t0 in range(s0, s1, chunk):
                t1 = min(s1, t0 + chunk)
                s = torch.einsum("thd,shd->hts", q[b, t0:t1], kd) * mla.scale
                allowed = torch.arange(s0, s1, device=x.device)[None, :] <= torch.arange(t0, t1, device=x.device)[:, None]
                s = s.masked_fill(~allowed[None], float("-inf"))
                best = torch.maximum(best, s.amax(dim=(1, 2)))
    return best


class MaxLogitTracker:
    """Forward hooks on every Gated MLA module that keep the running per-head max logit
    while `recording()` is active (decode calls with a cache are ignored)."""

    def __init__(self, model: nn.Module, chunk: int = 1024):
        self.chunk = chunk
        self.modules = {n: m for n, m in model.named_modules() if all(hasattr(m, a) for a in ("queries", "latent", "kv_b_proj"))}
        self.max: dict[str, torch.Tensor] = {}
        self.active = False
        self.handles = [m.register_forward_hook(partial(self._hook, n), with_kwargs=True) for n, m in self.modules.items()]

    def _hook(self, name, module, args, kwargs, output):
        if not self.active or kwargs.get("cache") is not None:
            return
        x = args[0] if args else kwargs["x"]
        cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        with torch.no_grad():
            m = mla_max_logits(module, x.detach(), cu, self.chunk)
        self.max[name] = m if name not in self.max else torch.maximum(self.max[name], m)

    @contextmanager
    def recording(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def pop(self) -> dict[str, torch.Tensor]:
        """The maxima recorded since the last pop (and forget them)."""
        out, self.max = self.max, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
