"""The vision tower: patch embedding, learned + 2-D rotary positions, pre-norm ViT blocks with
variable-length attention over images, the 2x2 merger and the deepstack mergers.

Legend: N patches (all images), I images, d vision width, P patch dim (C*T*p*p), hd head dim,
O text width (merger output).

    tokens_O, deepstack = VisionEncoder(cfg)(pixel_values_NP, grid_thw_I3)   # N/4 rows each
    VisionEncoder(cfg)(pixel_values_NP, None, layout.to(device))  # vision_layout(grid, ...) on the host

The patch embedding is a (d, P) linear weight (the reference's Conv3d with stride = kernel).
Regions a build step may wrap: each block, its MLP, each LayerNorm (`region`), the attention
kernel (`attn.core`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.attention import CoreAttention, DocMask, doc_mask
from moevlm.model.config import VisionConfig
from moevlm.model.linear import Linear
from moevlm.model.region import run_region
from moevlm.model.rope import (
    apply_rotary,
    pos_embed_taps,
    vision_cu_seqlens,
    vision_patch_rows_cols,
    vision_rotary,
)

_ACT = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with a region a build step may wrap (`region`: recompute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_region(self, "region", super().forward, x)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.core = CoreAttention()

    def forward(self, x_Nd, cos_sin, mask: DocMask):
        N = x_Nd.shape[0]
        q, k, v = self.qkv(x_Nd).view(N, 3, self.num_heads, -1).unbind(1)
        cos, sin = (t[:, None, :] for t in cos_sin)
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        out = self.core(q[None], k[None], v[None], mask)
        return self.proj(out.reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.hidden_act = cfg.hidden_act
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return run_region(self, "region", self._forward, x)

    def _forward(self, x):
        return self.linear_fc2(_ACT[self.hidden_act](self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x_Nd, cos_sin, mask: DocMask):
        return run_region(self, "region", self._forward, x_Nd, cos_sin, mask)

    def _forward(self, x_Nd, cos_sin, mask):
        x_Nd = x_Nd + self.attn(self.norm1(x_Nd), cos_sin, mask)
        return x_Nd + self.mlp(self.norm2(x_Nd))


class PatchMerger(nn.Module):
    """Four neighbouring patches -> one text token.  The main merger normalizes each
    patch (width d) before the shuffle; deepstack mergers normalize after (4d)."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(
            self.width if postshuffle_norm else cfg.hidden_size, eps=cfg.layer_norm_eps
        )
        self.linear_fc1 = Linear(self.width, self.width)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size)

    def forward(self, x_Nd: torch.Tensor) -> torch.Tensor:
        x = (
            self.norm(x_Nd.reshape(-1, self.width))
            if self.postshuffle_norm
            else self.norm(x_Nd).reshape(-1, self.width)
        )
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    static_mask = False  # fixed-size mask tensors only (set by moevlm.parallel.compile)

    def __init__(self, cfg: VisionConfig, attn_backend: str = "auto"):
        super().__init__()
        self.cfg, self.attn_backend = cfg, attn_backend
        self.side = math.isqrt(cfg.num_position_embeddings)
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )

    def forward(
        self,
        pixel_values_NP: torch.Tensor,
        grid_thw_I3: torch.Tensor | None,
        layout: VisionLayout | None = None,
    ):
        """Returns (merged tokens (N/4, O), [deepstack features (N/4, O)]).  `layout`: the patches'
        positions and segments already on the device (a captured step's static buffers); without it
        they are laid out here from the host grid."""
        cfg = self.cfg
        x_Nd = self.patch_embed(pixel_values_NP.to(self.patch_embed.weight.dtype))
        if layout is None:
            host = vision_layout(grid_thw_I3.cpu(), cfg.spatial_merge_size, self.side)
            # the segment bounds stay on the host: a mask built from a list reads nothing back
            layout = host.map(lambda t: t.to(x_Nd.device, non_blocking=True), bounds=False)
        x_Nd = x_Nd + (
            self.pos_embed(layout.pos_idx_N4) * layout.pos_wts_N4[..., None].to(x_Nd.dtype)
        ).sum(1)
        cos_sin = vision_rotary(layout.rows_cols_N2, cfg.head_dim, cfg.rope_theta)
        mask = doc_mask(
            1,
            x_Nd.shape[0],
            layout.cu_seqlens,
            causal=False,
            backend=self.attn_backend,
            device=x_Nd.device,
            dtype=x_Nd.dtype,
            static=self.static_mask,
        )
        deepstack = []
        for i, block in enumerate(self.blocks):
            x_Nd = block(x_Nd, cos_sin, mask)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(
                    self.deepstack_mergers[cfg.deepstack_visual_indexes.index(i)](x_Nd)
                )
        return self.merger(x_Nd), deepstack


@dataclass
class VisionLayout:
    """Where each patch sits, laid out on the host from the grids: the learned table's 4 bilinear taps
    (indices, weights), the (row, col) the rotary turns by, and the attention segments (one per frame)."""

    pos_idx_N4: torch.Tensor
    pos_wts_N4: torch.Tensor
    rows_cols_N2: torch.Tensor
    cu_seqlens: torch.Tensor

    def map(self, fn, bounds: bool = True) -> VisionLayout:
        """fn of every tensor (`bounds=False`: cu_seqlens as it is)."""
        return VisionLayout(
            *(
                getattr(self, f.name)
                if f.name == "cu_seqlens" and not bounds
                else fn(getattr(self, f.name))
                for f in fields(self)
            )
        )

    def to(self, device: torch.device) -> VisionLayout:
        return self.map(lambda t: t.to(device, non_blocking=True))

    def copy_(self, other: VisionLayout) -> None:
        """Copy `other` into these tensors (a captured step's static buffers)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine.shape != theirs.shape:
                raise RuntimeError(
                    f"the vision layout's {f.name} is {tuple(theirs.shape)}, captured as "
                    f"{tuple(mine.shape)}; the packer's budgets fix every shape"
                )
            mine.copy_(theirs, non_blocking=True)


def vision_layout(
    grid_thw_I3: torch.Tensor, merge: int, side: int, segments: int | None = None
) -> VisionLayout:
    """The VisionLayout of the patches of `grid_thw_I3` (host; zero rows are no image), in order;
    `segments`: the bounds padded to that many with empty segments (a captured step's fixed shapes)."""
    grid = grid_thw_I3[grid_thw_I3.prod(-1) > 0]
    rows_cols_N2 = vision_patch_rows_cols(grid, merge)
    idx, wts = pos_embed_taps(rows_cols_N2, grid, side)
    cu = vision_cu_seqlens(grid)
    if segments is not None:
        if cu.shape[0] > segments:
            raise ValueError(
                f"{cu.shape[0] - 1} frames need {cu.shape[0]} segment bounds, over {segments}"
            )
        cu = torch.cat([cu, cu[-1:].expand(segments - cu.shape[0])])
    return VisionLayout(idx, wts, rows_cols_N2, cu)
