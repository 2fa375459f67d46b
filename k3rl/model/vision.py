"""MoonViT-V2 vision tower, sd2_tpool merge and patchmergerv2 projector (docs/model.md §7.2-§7.4).

    x   = PatchEmbed(patches) + bilinear(pos_grid -> (gh, gw)) [+ temporal sincos if t > 1]
    x   = x + Wo Attn(RMSNorm(x))        joint bidirectional attention within each media item,
    x   = x + fc1 gelu_tanh(fc0 RMSNorm(x))       2D RoPE on q, k; no biases; eps 2^-7
    x   = RMSNorm(x)
    tok = mean_t, group 2x2 -> [gh*gw/4, 4w]  ->  RMSNorm(W2 gelu(W1 tok))   (LM width)
The projected rows replace the `<|media_pad|>` embeddings of the token stream in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import RMSNorm
from .config import K3Config, VisionConfig
from .vision_preprocess import MediaBatch


def temporal_sincos(num_frames: int, width: int) -> torch.Tensor:
    """[num_frames, width]: frequencies 10000^(-i/(width/2)), laid out [sin | cos], frame 0..t-1."""
    half = width // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(num_frames, dtype=torch.float64)[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


def rope_2d_angles(t: int, gh: int, gw: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """Angles [t*gh*gw, head_dim/2]: pair 2i turns by col * theta_i, pair 2i+1 by row * theta_i,
    theta_i = theta^(-4i/head_dim), i < head_dim/4; repeated for every frame (no temporal RoPE)."""
    n = head_dim // 4
    freqs = theta ** (-4.0 * torch.arange(n, dtype=torch.float32, device=device) / head_dim)
    idx = torch.arange(gh * gw, device=device)
    row, col = (idx // gw).float(), (idx % gw).float()
    ang = torch.empty(gh * gw, 2 * n, device=device)
    ang[:, 0::2] = col[:, None] * freqs
    ang[:, 1::2] = row[:, None] * freqs
    return ang.repeat(t, 1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x_{2p}, x_{2p+1}) of x [n, heads, head_dim] by angles [n, head_dim/2], in fp32."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)  # back to the input dtype, or the tower silently promotes


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, vc.vt_hidden_size, vc.patch_size, stride=vc.patch_size, bias=False)
        self.pos_emb = nn.Module()
        # zeros, not torch.empty: a tower built on its own must not read uninitialised memory (it gave NaN
        # once in CI); K3Model.reset_parameters draws the real values (no RNG used here, so a seeded
        # model's weights are unchanged)
        self.pos_emb.weight = nn.Parameter(torch.zeros(vc.init_pos_emb_height, vc.init_pos_emb_width, vc.vt_hidden_size))
        self.register_buffer("time_emb", temporal_sincos(vc.init_pos_emb_time, vc.vt_hidden_size), persistent=False)

    def positions(self, t: int, gh: int, gw: int, dtype) -> torch.Tensor:
        grid = self.pos_emb.weight
        if (gh, gw) != tuple(grid.shape[:2]):
            grid = F.interpolate(grid.permute(2, 0, 1)[None].float(), size=(gh, gw), mode="bilinear",
                                 align_corners=False)[0].permute(1, 2, 0)
        pos = grid.reshape(1, gh * gw, -1).to(dtype).expand(t, -1, -1)
        if t > 1:  # row 0 of the sincos table is not zero, so it is only added for videos
            if t > self.time_emb.shape[0]:
                raise ValueError(f"a media item has {t} frames; chunks hold at most {self.time_emb.shape[0]}")
            pos = pos + self.time_emb[:t, None, :].to(dtype)
        return pos.reshape(t * gh * gw, -1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        dtype = pixel_values.dtype
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1).to(dtype)  # [N, w]
        pos = torch.cat([self.positions(t, gh, gw, dtype) for t, gh, gw in grid_thw])
        return x + pos


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(vc.vt_hidden_size, vc.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(vc.vt_intermediate_size, vc.vt_hidden_size, bias=False)

    def forward(self, x):
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.heads = vc.vt_num_attention_heads
        self.head_dim = vc.qkv_hidden_size // vc.vt_num_attention_heads
        self.theta = vc.rope_theta
        self.layout = vc.vt_attention
        self.norm0 = RMSNorm(vc.vt_hidden_size, vc.vt_norm_eps)
        self.wqkv = nn.Linear(vc.vt_hidden_size, 3 * vc.qkv_hidden_size, bias=False)  # packed (3, heads, hd)
        self.wo = nn.Linear(vc.qkv_hidden_size, vc.vt_hidden_size, bias=False)
        self.norm1 = RMSNorm(vc.vt_hidden_size, vc.vt_norm_eps)
        self.mlp = VisionMLP(vc)

    def attention(self, x: torch.Tensor, grid_thw, angles: list[torch.Tensor], mode: str = "joint") -> torch.Tensor:
        """Attention within each media item only. mode: "joint" (all t*gh*gw patches of the item),
        "spatial" (patches of the same frame) or "temporal" (the t frames of each patch position;
        zero for single frames, which have nothing to attend across)."""
        qkv = self.wqkv(x).reshape(x.shape[0], 3, self.heads, self.head_dim)
        outs, start = [], 0
        for (t, gh, gw), ang in zip(grid_thw, angles, strict=True):
            n, s = t * gh * gw, gh * gw
            if mode == "temporal" and t == 1:
                outs.append(x.new_zeros(n, self.heads * self.head_dim))
                start += n
                continue
            q, k, v = qkv[start : start + n].unbind(1)
            q, k = apply_rope(q, ang), apply_rope(k, ang)  # (same rotation for all frames of a position)
            q, k, v = (_groups(z, t, s, mode) for z in (q, k, v))  # [groups, heads, length, hd]
            o = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-1/2
            outs.append(_ungroup(o, t, s, mode))
            start += n
        return self.wo(torch.cat(outs))

    def forward(self, x, grid_thw, angles):
        if self.layout == "joint":
            x = x + self.attention(self.norm0(x), grid_thw, angles, "joint")
        else:  # factorised: an intra-frame pass, then an inter-frame pass, with the same weights
            x = x + self.attention(self.norm0(x), grid_thw, angles, "spatial")
            x = x + self.attention(self.norm0(x), grid_thw, angles, "temporal")
        return x + self.mlp(self.norm1(x))


def _groups(z: torch.Tensor, t: int, s: int, mode: str) -> torch.Tensor:
    """[t*s, heads, hd] patches (frame-major) -> [groups, heads, length, hd] attention groups."""
    if mode == "joint":
        return z.transpose(0, 1)[None]  # one group of t*s
    z = z.reshape(t, s, *z.shape[1:])
    return z.transpose(1, 2) if mode == "spatial" else z.permute(1, 2, 0, 3)  # [t, h, s, d] / [s, h, t, d]


def _ungroup(o: torch.Tensor, t: int, s: int, mode: str) -> torch.Tensor:
    """Inverse of `_groups`, flattened to [t*s, heads*hd]."""
    o = o.permute(2, 0, 1, 3) if mode == "temporal" else o.transpose(1, 2)  # [t, s, h, d] or [1, t*s, h, d]
    return o.reshape(t * s, -1)


class VisionEncoder(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(vc.vt_hidden_size, vc.vt_norm_eps)


class MoonViT(nn.Module):
    """`vision_tower`: patches [N, 3, p, p] + grid_thw -> per-patch features [N, w] (input dtype)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.config = vc
        self.patch_embed = PatchEmbed(vc)
        self.encoder = VisionEncoder(vc)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        expected = sum(t * gh * gw for t, gh, gw in grids)
        if pixel_values.shape[0] != expected:
            raise ValueError(f"vision: grid_thw describes {expected} patches but pixel_values has {pixel_values.shape[0]}")
        x = self.patch_embed(pixel_values, grids)
        head_dim = self.encoder.blocks[0].head_dim if len(self.encoder.blocks) else 4
        angles = [rope_2d_angles(t, gh, gw, head_dim, self.config.rope_theta, x.device) for t, gh, gw in grids]
        for block in self.encoder.blocks:
            x = block(x, grids, angles)
        return self.encoder.final_layernorm(x)


def merge_sd2_tpool(features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Average over frames, group 2x2 patches (inner order row offset, col offset) -> [sum gh*gw/4, 4w]."""
    out, start = [], 0
    for t, gh, gw in grid_thw.tolist():
        n = t * gh * gw
        x = features[start : start + n].reshape(t, gh // 2, 2, gw // 2, 2, -1).mean(0)
        out.append(x.permute(0, 2, 1, 3, 4).reshape((gh // 2) * (gw // 2), -1))
        start += n
    return torch.cat(out)


class PatchMergerV2(nn.Module):
    """`mm_projector`: Linear(4w, 4w) -> GELU (erf) -> Linear(4w, d) -> RMSNorm(d, 1e-5)."""

    def __init__(self, config: K3Config):
        super().__init__()
        vc = config.vision_config
        merged = vc.mm_hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=False), nn.GELU(), nn.Linear(merged, config.hidden_size, bias=False)
        )
        self.post_norm = RMSNorm(config.hidden_size, vc.projector_ln_eps)

    def forward(self, x):
        return self.post_norm(self.proj(x))


def check_grid(grid_thw: torch.Tensor) -> None:
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [items, 3] (t, gh, gw); got shape {tuple(grid_thw.shape)}")
    if bool(((grid_thw[:, 1] % 2) | (grid_thw[:, 2] % 2)).any()):
        raise ValueError(f"grid_thw heights and widths must be even (padding to multiples of 28); got {grid_thw.tolist()}")


def merge_media_embeddings(
    embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor, media: MediaBatch, placeholder_id: int
) -> torch.Tensor:
    """Put the projected media rows at the placeholder positions, in order (§7.4)."""
    mask = input_ids == placeholder_id
    n_pads = int(mask.sum())
    per_item = media.tokens_per_item()
    if n_pads != features.shape[0]:
        raise ValueError(
            f"media placeholder mismatch: the tokens hold {n_pads} <|media_pad|> (id {placeholder_id}) but the "
            f"{len(per_item)} media item(s) give {features.shape[0]} rows (per item {per_item}); each item needs "
            f"exactly gh*gw/4 pad tokens"
        )
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))
