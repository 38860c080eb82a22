"""Qwen3-VL-MoE: vision tower -> merger (+ deepstack) -> MoE decoder -> LM head.

Legend: B batch, S sequence, V vocab, N patches, I images, O text width.

    model = Qwen3VLMoe(VLMConfig.preset("tiny"))            # built and initialized, one process
    with torch.device("meta"): model = Qwen3VLMoe(cfg, strategies=...)   # build_model, then
    model.to_empty(device="cuda"); model.init_weights()    # materialize + init
    model = Qwen3VLMoe.from_pretrained(hf_dir)              # HF checkpoint folder
    out = model(input_ids, pixel_values, image_grid_thw, labels=labels)

`labels` follow the Hugging Face convention (same positions as `input_ids`, -100 ignored; the
shift happens here).  `out.loss = lm_loss + router_aux_loss_coef * aux_loss`.  With labels and
`config.loss_chunk_tokens` > 0 the LM head's loss runs over token chunks and `out.logits` is None
(`return_logits=True` computes them, and the loss through them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from moevlm.model.config import VLMConfig
from moevlm.model.decoder import Head, RMSNorm, TextDecoder
from moevlm.model.gated_deltanet import GatedDeltaNet
from moevlm.model.linear import is_adapter
from moevlm.model.lora import attach_lora, lora_init_rules
from moevlm.model.moe import MoEBlock, RouterStats, layer_extras, load_balancing_loss
from moevlm.model.rope import mrope_position_ids
from moevlm.model.strategies import (
    IGNORE_INDEX,
    Strategies,
    laid_out_positions,
    local,
    next_token_targets,
    place_rows,
    token_loss,
    true_positions,
)
from moevlm.model.vision import VisionEncoder, VisionLayout, vision_layout


@dataclass
class VLMOutput:
    # (B, S, V); None when labels were given and config.loss_chunk_tokens > 0 (not materialized)
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    num_loss_tokens: torch.Tensor | None = None
    expert_counts: torch.Tensor | None = None  # (MoE layers, E) top-k selections
    z_loss: torch.Tensor | None = None  # moe.z_loss_coeff > 0: sum over layers of mean logsumexp^2
    # the router statistics summed over layers (moe.aux_loss=global_batch: the trainer's aux loss)
    router_totals: RouterStats | None = None


class Qwen3VLMoe(nn.Module):
    def __init__(self, config: VLMConfig, strategies: Strategies | None = None):
        super().__init__()
        self.config = config.validate()
        self.strategies = strategies = strategies or Strategies()
        self.vision = VisionEncoder(config.vision, config.attn_backend)
        self.text = TextDecoder(config, strategies)
        self.lm_head = Head(config.text.hidden_size, config.text.vocab_size, strategies.vocab)
        self.loss = strategies.loss()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.text.embed_tokens.weight
        if config.lora.rank:  # adapters beside the chosen linears and experts, the base frozen
            attach_lora(self, config.lora)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_rules(self) -> dict[str, tuple[str, float]]:
        """How every parameter starts, by name: ("normal", std) for matrices,
        ("zeros", 0) for biases, ("ones", 0) for norms.  `init_weights` applies it
        with the global RNG; the trainer applies it per parameter with its own
        seeded generator (`moevlm.parallel.init_parameters_`), the same under any layout."""
        rules: dict[str, tuple[str, float]] = {}
        for prefix, tower, std in (
            ("vision.", self.vision, self.config.vision.initializer_range),
            ("text.", self.text, self.config.text.initializer_range),
        ):
            _init_rules(tower, prefix, std, rules)
        if not self.config.tie_word_embeddings:
            rules["lm_head.weight"] = ("normal", self.config.text.initializer_range)
        rules.update(lora_init_rules(self))
        return rules

    @torch.no_grad()
    def init_weights(self, only: Callable[[str], bool] | None = None) -> None:
        """Normal(0, initializer_range) for matrices, zeros for biases, ones for norms (the parameters
        whose names `only` accepts, default all)."""
        params = dict(self.named_parameters())
        for name, (kind, std) in self.init_rules().items():
            if only is None or only(name):
                fill_(params[name], kind, std)

    def set_attn_backend(self, backend: str) -> None:
        """Switch attention backend (the function computed does not change)."""
        self.config.attn_backend = backend
        self.config.validate()
        self.vision.attn_backend = self.text.attn_backend = backend

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        return_logits: bool = False,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        visual_tokens: tuple[int, int] | None = None,
        inputs_checked: bool = False,
        vision_layout: VisionLayout | None = None,
    ) -> VLMOutput:
        """`token_mask` (B, S), True at real tokens: padding is left out of the
        router statistics (aux loss, `expert_counts`); it changes nothing else.
        `return_logits`: the logits even when the loss could be computed without them.
        `pixel_values_videos` (N, C*T*P*P) and `video_grid_thw` (V, 3): videos, as transformers
        takes them (their tokens are `video_token_id`; trailing padding patches and zero grid rows
        allowed as for images).  `visual_tokens`: the numbers of image and video tokens in
        `input_ids` where the caller knows them on the host (the trainer's micro-batches: the
        loader placed them), so the input checks read nothing from the device; None counts them
        here (one device-to-host read when input_ids is on a GPU).  `inputs_checked`: the caller ran
        `check_inputs` on host copies of these inputs (a captured step: nothing is read here).
        `vision_layout`: the images' (or the videos') layout on the device, laid out on the host from
        their grids (`image_layout`; a captured step's static buffers): every shape is then fixed by
        the pixel tensor's, the padding patches' rows included, and the grid is not read (one kind:
        images or videos)."""
        cfg = self.config
        if not inputs_checked:
            check_inputs(
                cfg,
                input_ids,
                pixel_values,
                image_grid_thw,
                position_ids,
                cu_seqlens,
                labels,
                token_mask,
                pixel_values_videos,
                video_grid_thw,
                visual_tokens,
            )
        self.strategies.sequence.begin(cu_seqlens, *input_ids.shape, input_ids.device)
        if vision_layout is not None:
            if (pixel_values is None) == (pixel_values_videos is None):
                raise ValueError(
                    "vision_layout lays out one kind: pixel_values or pixel_values_videos, not both"
                )
            h_BSD, visual_mask_BS, deepstack = self.embed_laid_out(
                input_ids, pixel_values, pixel_values_videos, vision_layout
            )
        else:
            h_BSD, visual_mask_BS, deepstack, n_image = self.embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
            deepstack = [d[:n_image] for d in deepstack]
        if position_ids is None:
            position_ids = mrope_position_ids(
                input_ids,
                image_grid_thw,
                cfg.image_token_id,
                cfg.vision.spatial_merge_size,
                cu_seqlens,
                video_grid_thw,
                cfg.video_token_id,
            )
        elif position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        h_BSD, stats = self.text(
            h_BSD, position_ids, cu_seqlens, visual_mask_BS, deepstack, token_mask
        )
        chunked = labels is not None and cfg.loss_chunk_tokens > 0 and not return_logits
        out = VLMOutput(logits=None if chunked else self.lm_head(h_BSD))
        if stats:
            self.router_outputs(out, stats)
        if labels is not None:
            out.lm_loss, out.num_loss_tokens = (
                self.head_loss(h_BSD, labels, cu_seqlens)
                if chunked
                else self.lm_loss(out.logits, labels, cu_seqlens)
            )
            out.loss = out.lm_loss
            if out.aux_loss is not None:
                out.loss = out.lm_loss + cfg.moe.router_aux_loss_coef * out.aux_loss
            if out.z_loss is not None:
                out.loss = out.loss + cfg.moe.z_loss_coeff * out.z_loss
        return out

    def router_outputs(self, out: VLMOutput, stats: list[RouterStats]) -> None:
        """aux loss of moe.aux_loss (global_batch: this micro-batch's own; the trainer forms the
        step's from `router_totals`), z-loss, expert counts."""
        moe = self.config.moe
        E = moe.num_experts
        seq, out.z_loss = layer_extras(stats, E)
        out.aux_loss = load_balancing_loss(stats, E) if seq is None else seq / len(stats)
        out.expert_counts = torch.stack([s.counts_E for s in stats]).detach()
        if moe.aux_loss == "global_batch":
            out.router_totals = RouterStats(
                torch.stack([s.prob_sum_E for s in stats]).sum(0),
                out.expert_counts.sum(0),
                sum(s.num_tokens for s in stats),
            )

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ):
        """Token embeddings with the image and video features scattered in at their tokens.

        Returns (h_BSD, visual mask or None, deepstack features, n): the deepstack
        features' first n rows are the visual tokens' (images and videos, in token order), then
        the rows of the padding patches (the images', then the videos'), so their shape depends
        only on the pixel tensors' (a pipeline stage sends them whole; `forward` keeps the first n)."""
        h_BSD = self.text.embed_tokens(input_ids)
        cfg = self.config
        kinds = [
            (pixels, grid[grid.prod(-1) > 0], input_ids == token_id)  # a packed batch's unused rows
            for pixels, grid, token_id in (
                (pixel_values, image_grid_thw, cfg.image_token_id),
                (pixel_values_videos, video_grid_thw, cfg.video_token_id),
            )
            if pixels is not None
        ]
        if not kinds:
            return h_BSD, None, [], 0
        pixels_NP, grid_I3 = _one_tower_input(kinds)
        out_NO, deepstack, n = self.encode_images(pixels_NP, grid_I3)
        visual_mask_BS = kinds[0][2] if len(kinds) == 1 else kinds[0][2] | kinds[1][2]
        rows = [out_NO, *deepstack]
        if len(kinds) == 2:  # the tower's rows are the images' then the videos': to token order
            is_image = kinds[0][2].reshape(-1)[true_positions(visual_mask_BS, n)]
            rows = [_in_token_order(t, is_image, n) for t in rows]
        # An exact 0 that depends on every vision output: the whole tower is in the graph even when a
        # micro-batch holds only padding patches, so data-parallel ranks run the same backward
        # (same FSDP reduce-scatters) whether or not they drew an image.
        padding_zero = sum(t[n:].sum() for t in rows) * 0.0
        h_BSD = place_rows(h_BSD, visual_mask_BS, rows[0][:n])
        return h_BSD + padding_zero.to(h_BSD.dtype), visual_mask_BS, rows[1:], n

    def embed_laid_out(self, input_ids, pixel_values, pixel_values_videos, layout: VisionLayout):
        """`embed` of images, or videos, laid out on the host (`forward`'s `vision_layout`): (h_BSD,
        the visual tokens' positions (`laid_out_positions`), deepstack features), every output of the
        tower whole.  Its padding rows land on no token (`place_rows`), which keeps the whole tower in
        the graph, as `embed`'s exact 0 does."""
        h_BSD = self.text.embed_tokens(input_ids)
        images = pixel_values is not None
        token_id = self.config.image_token_id if images else self.config.video_token_id
        pixels = pixel_values if images else pixel_values_videos
        out_NO, deepstack = self.vision(pixels, None, layout)
        where = laid_out_positions(input_ids == token_id, out_NO.shape[0])
        return place_rows(h_BSD, where, out_NO), where, deepstack

    def encode_images(self, pixel_values_NP, grid_thw_I3):
        """(image tokens, deepstack features, n) of every image, the work shared as the strategies'
        `images` strategy says."""
        merge = self.config.vision.spatial_merge_size
        return self.strategies.images.encode(
            self.encode_own_images, pixel_values_NP, grid_thw_I3, merge
        )

    def encode_own_images(self, pixel_values_NP, grid_thw_I3):
        """(image tokens, deepstack features, n): patches beyond the grids (a packed
        batch's padding) run as one extra segment, isolated in attention; their merged
        tokens are the rows after the first n of every output."""
        merge = self.config.vision.spatial_merge_size
        grid_thw_I3, used = _with_padding_segment(grid_thw_I3, pixel_values_NP.shape[0], merge)
        image_NO, deepstack = self.vision(pixel_values_NP, grid_thw_I3)
        return image_NO, deepstack, used // merge**2

    def lm_loss(self, logits_BSV, labels_BS, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean next-token loss over the targets this rank holds, their number): the loss strategy's."""
        return self.loss(logits_BSV, labels_BS, cu_seqlens)

    def head_loss(self, h_BSD, labels_BS, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
        """`lm_loss` of the LM head over the final hidden states: through the whole logits, or with
        config.loss_chunk_tokens > 0 that many tokens at a time without them (moevlm.model.linear_ce)."""
        chunk = self.config.loss_chunk_tokens
        if chunk <= 0:
            return self.lm_loss(self.lm_head(h_BSD), labels_BS, cu_seqlens)
        x = self.lm_head(h_BSD, as_input=True)
        return self.loss(x, labels_BS, cu_seqlens, local(self.lm_head.weight), chunk)

    # ------------------------------------------------------- checkpoints (HF)
    @classmethod
    def from_pretrained(
        cls,
        hf_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        expert_layout: str = "auto",
        **overrides,
    ) -> "Qwen3VLMoe":
        """Load a Hugging Face Qwen3-VL-MoE folder (config.json + safetensors).
        `overrides` replace top-level config fields (e.g. attn_backend="sdpa")."""
        from moevlm.model.hf import load_pretrained

        model = load_pretrained(
            cls, hf_dir, device=device, dtype=dtype, expert_layout=expert_layout, **overrides
        )
        model.init_weights(only=is_adapter)  # LoRA adapters (lora.rank > 0) are not in a checkpoint
        return model

    def save_pretrained(
        self, out_dir: str | Path, *, expert_layout: str = "hub", max_shard_bytes: int = 5 << 30
    ) -> None:
        """Export as a Hugging Face Qwen3-VL-MoE folder that transformers loads."""
        from moevlm.model.hf import save_pretrained

        save_pretrained(self, out_dir, expert_layout=expert_layout, max_shard_bytes=max_shard_bytes)


def from_pretrained(hf_dir: str | Path, **kwargs) -> Qwen3VLMoe:
    """The model of a Hugging Face folder, of the family its config.json names (Qwen3-VL-MoE or
    Qwen3.5-MoE); `kwargs` as `Qwen3VLMoe.from_pretrained`'s."""
    return Qwen3VLMoe.from_pretrained(hf_dir, **kwargs)


def image_layout(cfg: VLMConfig, pixel_values_NP: torch.Tensor, image_grid_thw_I3: torch.Tensor):
    """The VisionLayout of a micro-batch's images (or videos) on the host (`forward`'s
    `vision_layout`): their patches, then the padding patches as one segment, the segment bounds
    padded to a number fixed by the pixel tensor's shape (a frame has at least merge^2 patches)."""
    merge, N = cfg.vision.spatial_merge_size, pixel_values_NP.shape[0]
    grid, _ = _with_padding_segment(image_grid_thw_I3.cpu(), N, merge)
    side = math.isqrt(cfg.vision.num_position_embeddings)
    return vision_layout(grid, merge, side, segments=N // merge**2 + 2)


def _with_padding_segment(grid_thw_I3: torch.Tensor, patches: int, merge: int):
    """(the grids and, when the pixel tensor's `patches` are more than theirs, one more grid for the
    padding patches: their own segment, isolated in attention; the grids' patches)."""
    used = int(grid_thw_I3.prod(-1).sum())
    pad = patches - used
    if pad:
        grid_thw_I3 = torch.cat([grid_thw_I3, grid_thw_I3.new_tensor([[1, merge, pad // merge]])])
    return grid_thw_I3, used


def _one_tower_input(kinds) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, grids) of images and videos for one run of the tower (one set of collectives under any
    layout): every kind's real patches, then every kind's padding patches."""
    if len(kinds) == 1:
        return kinds[0][0], kinds[0][1]
    used = [int(n) for n in torch.stack([grid.prod(-1).sum() for _, grid, _ in kinds]).tolist()]
    pixels = [p[:u] for (p, _, _), u in zip(kinds, used)] + [
        p[u:] for (p, _, _), u in zip(kinds, used)
    ]
    return torch.cat(pixels), torch.cat([grid for _, grid, _ in kinds])


def _in_token_order(t_NO: torch.Tensor, is_image_n: torch.Tensor, n: int) -> torch.Tensor:
    """The tower's first n rows (the images' then the videos') in the visual tokens' order, given
    which visual token is an image's; the padding rows after them unchanged."""
    n_image = is_image_n.sum()
    src_n = torch.where(is_image_n, is_image_n.cumsum(0) - 1, n_image + (~is_image_n).cumsum(0) - 1)
    return torch.cat([t_NO[:n][src_n], t_NO[n:]])


def check_inputs(
    cfg: VLMConfig,
    input_ids,
    pixel_values,
    image_grid_thw,
    position_ids,
    cu_seqlens,
    labels,
    token_mask=None,
    pixel_values_videos=None,
    video_grid_thw=None,
    visual_tokens: tuple[int, int] | None = None,
):
    """Shape and consistency checks, on the host, before any activation is allocated.
    `visual_tokens`: the image and video token counts as the caller knows them (else counted)."""
    _require(
        input_ids.ndim == 2 and not input_ids.is_floating_point(),
        f"input_ids must be a 2-D integer tensor (batch, seq), got {tuple(input_ids.shape)} {input_ids.dtype}",
    )
    B, S = input_ids.shape
    if visual_tokens is not None:
        n_img_tokens, n_vid_tokens = visual_tokens
    else:  # both counts in one host read: image tokens * (B*S + 1) + video tokens
        both = int(
            (input_ids == cfg.image_token_id).sum() * (B * S + 1)
            + (input_ids == cfg.video_token_id).sum()
        )
        n_img_tokens, n_vid_tokens = divmod(both, B * S + 1)
    if (pixel_values is None) != (image_grid_thw is None):
        missing = "image_grid_thw" if image_grid_thw is None else "pixel_values"
        raise ValueError(f"{missing} is missing: pixel_values and image_grid_thw come together")
    if pixel_values is None:
        _require(
            n_img_tokens == 0,
            f"input_ids has {n_img_tokens} image tokens (image_token_id="
            f"{cfg.image_token_id}) but no pixel_values/image_grid_thw were given",
        )
    else:
        _check_images(cfg, pixel_values, image_grid_thw, n_img_tokens)
    if (pixel_values_videos is None) != (video_grid_thw is None):
        missing = "video_grid_thw" if video_grid_thw is None else "pixel_values_videos"
        raise ValueError(
            f"{missing} is missing: pixel_values_videos and video_grid_thw come together"
        )
    if pixel_values_videos is None:
        _require(
            n_vid_tokens == 0,
            f"input_ids has {n_vid_tokens} video tokens (video_token_id={cfg.video_token_id}) but no "
            "pixel_values_videos/video_grid_thw were given",
        )
    else:
        _check_images(cfg, pixel_values_videos, video_grid_thw, n_vid_tokens, _VIDEO_NAMES)
    if cu_seqlens is not None:
        c = cu_seqlens.tolist()
        _require(
            cu_seqlens.ndim == 1
            and len(c) >= 2
            and c[0] == 0
            and c[-1] == B * S
            and all(a <= b for a, b in zip(c, c[1:])),
            f"cu_seqlens must be non-decreasing boundaries from 0 to batch*seq={B * S}, got {c[:8]}...",
        )
    if position_ids is not None:
        _require(
            tuple(position_ids.shape) in ((3, B, S), (B, S)),
            f"position_ids must be (3, {B}, {S}) or ({B}, {S}), got {tuple(position_ids.shape)}",
        )
    if token_mask is not None:
        _require(
            token_mask.shape == input_ids.shape and token_mask.dtype == torch.bool,
            f"token_mask must be a bool tensor shaped like input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(token_mask.shape)} {token_mask.dtype}",
        )
    if labels is not None:
        _require(
            labels.shape == input_ids.shape,
            f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}",
        )


_IMAGE_NAMES = dict(pixels="pixel_values", grid="image_grid_thw", n="num_images", token="image")
_VIDEO_NAMES = dict(
    pixels="pixel_values_videos", grid="video_grid_thw", n="num_videos", token="video"
)


def _check_images(
    cfg: VLMConfig, pixel_values, image_grid_thw, n_img_tokens: int, names=_IMAGE_NAMES
) -> None:
    v, pixels, grid, token = cfg.vision, names["pixels"], names["grid"], names["token"]
    _require(
        image_grid_thw.ndim == 2 and image_grid_thw.shape[1] == 3,
        f"{grid} must be ({names['n']}, 3), got {tuple(image_grid_thw.shape)}",
    )
    merge = v.spatial_merge_size
    for i, (t, h, w) in enumerate(image_grid_thw.tolist()):
        _require(
            (t, h, w) == (0, 0, 0)
            or (t >= 1 and h > 0 and w > 0 and h % merge == 0 and w % merge == 0),
            f"{grid}[{i}]=({t}, {h}, {w}): t >= 1 and h, w positive multiples of "
            f"spatial_merge_size={merge} are required (or all zeros: an unused row of a packed batch)",
        )
    n_patches = int(image_grid_thw.prod(-1).sum())
    _require(
        pixel_values.ndim == 2 and pixel_values.shape[1] == v.patch_dim,
        f"{pixels} must be (num_patches, {v.patch_dim}) = (N, C*T*P*P), got {tuple(pixel_values.shape)}",
    )
    pad = pixel_values.shape[0] - n_patches
    _require(
        pad >= 0 and pad % merge**2 == 0,
        f"{pixels} has {pixel_values.shape[0]} patches but {grid} describes {n_patches} "
        f"(trailing padding patches are allowed in multiples of spatial_merge_size^2={merge**2})",
    )
    _require(
        n_img_tokens * merge**2 == n_patches,
        f"input_ids has {n_img_tokens} {token} tokens ({token}_token_id="
        f"{getattr(cfg, token + '_token_id')}) but {grid} gives {n_patches // merge**2} "
        "(patches / spatial_merge_size^2)",
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _init_rules(module: nn.Module, prefix: str, std: float, rules: dict) -> None:
    for mname, m in module.named_modules():
        p = f"{prefix}{mname}." if mname else prefix
        if isinstance(m, (nn.Linear, nn.Embedding)):
            rules[p + "weight"] = ("normal", std)
            if getattr(m, "bias", None) is not None:
                rules[p + "bias"] = ("zeros", 0.0)
        elif isinstance(m, nn.LayerNorm):
            rules[p + "weight"], rules[p + "bias"] = ("ones", 0.0), ("zeros", 0.0)
        elif isinstance(m, RMSNorm):  # a zero-centred norm's scale is 1 + weight
            rules[p + "weight"] = ("zeros", 0.0) if m.zero_centered else ("ones", 0.0)
        elif isinstance(m, MoEBlock):
            for name in ("router.weight", "experts.gate_up_proj", "experts.down_proj"):
                rules[p + name] = ("normal", std)
        elif isinstance(m, GatedDeltaNet):  # the reference's: A = U(0.01, 16), dt_bias 1
            rules[p + "conv1d.weight"] = ("normal", std)
            rules[p + "dt_bias"], rules[p + "norm.weight"] = ("ones", 0.0), ("ones", 0.0)
            rules[p + "A_log"] = ("log_uniform", 0.0)


def fill_(t: torch.Tensor, kind: str, std: float, generator: torch.Generator | None = None) -> None:
    if kind == "normal":
        t.normal_(0.0, std, generator=generator)
    elif kind == "ones":
        t.fill_(1.0)
    elif kind == "uniform":  # U(-std, std): a LoRA A (moevlm.model.lora)
        t.uniform_(-std, std, generator=generator)
    elif kind == "log_uniform":  # log of U(0.01, 16): a Gated DeltaNet's A_log
        t.uniform_(0.01, 16.0, generator=generator).log_()
    else:
        t.zero_()


__all__ = [
    "IGNORE_INDEX",
    "Qwen3VLMoe",
    "VLMOutput",
    "check_inputs",
    "fill_",
    "next_token_targets",
    "token_loss",
]
