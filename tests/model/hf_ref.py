"""Helpers shared by the parity tests: an HF reference model built from one of our
configs, checkpoints written by it, and realistic multimodal inputs."""

from __future__ import annotations

import torch

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.hf import hf_to_ours

transformers = __import__("pytest").importorskip("transformers")


def hf_model(cfg: VLMConfig, seed: int = 0):
    """A transformers Qwen3VLMoeForConditionalGeneration with every parameter
    randomised (norm weights and biases too, so a mis-mapped one shows)."""
    hf_cfg = transformers.Qwen3VLMoeConfig(**cfg.to_hf("float32"))
    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(hf_cfg).eval()
    model.config._attn_implementation = "sdpa"
    model.set_experts_implementation("eager")  # the per-expert loop: the plainest reference
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(
                    1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p)
                )
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def pair(cfg: VLMConfig, tmp_path, seed: int = 0):
    """(hf model, ours loaded from the HF model's saved checkpoint)."""
    ref = hf_model(cfg, seed)
    ref.save_pretrained(tmp_path / "hf")
    ours = Qwen3VLMoe.from_pretrained(
        tmp_path / "hf", attn_backend=cfg.attn_backend, moe=cfg.moe
    ).eval()
    return ref, ours


def sample(
    cfg: VLMConfig,
    grids: list[tuple[int, int, int]],
    text_len: int = 7,
    batch: int = 1,
    seed: int = 0,
):
    """input_ids laid out as the chat template does: text, <vision_start>,
    image pads, <vision_end>, text ... for every image; plus pixel values."""
    g = torch.Generator().manual_seed(seed)
    merge = cfg.vision.spatial_merge_size
    rows = []
    for _ in range(batch):
        ids = [torch.randint(0, 1000, (text_len,), generator=g)]
        for t, h, w in grids:
            n = t * h * w // merge**2
            ids += [
                torch.tensor([cfg.vision_start_token_id]),
                torch.full((n,), cfg.image_token_id),
                torch.tensor([cfg.vision_end_token_id]),
                torch.randint(0, 1000, (text_len,), generator=g),
            ]
        rows.append(torch.cat(ids))
    input_ids = torch.stack(rows)
    if not grids:
        return input_ids, None, None
    grid = torch.tensor(grids * batch)
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.vision.patch_dim, generator=g)
    return input_ids, pixels, grid


def hf_forward(ref, input_ids, pixels, grid, labels=None):
    kw = {}
    if pixels is not None:
        kw = dict(
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == ref.config.image_token_id).int(),
        )
    return ref(input_ids=input_ids, labels=labels, output_router_logits=True, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def as_ours(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A reference parameter (or its gradient) under our name, in our layout."""
    ours = hf_to_ours(name)
    if ours.endswith(("experts.gate_up_proj", "experts.down_proj")):
        t = t.transpose(1, 2)  # transformers keeps (E, 2F, D) / (E, D, F) in memory
    elif ours == "vision.patch_embed.weight":
        t = t.reshape(t.shape[0], -1)
    return ours, t


def hf_grads_as_ours(ref, cfg: VLMConfig) -> dict[str, torch.Tensor]:
    """The reference's parameter gradients, renamed and reshaped to our layout."""
    return dict(
        as_ours(name, p.grad if p.grad is not None else torch.zeros_like(p))
        for name, p in ref.named_parameters()
    )


def qwen35_model(cfg: VLMConfig, seed: int = 0):
    """A transformers Qwen3_5MoeForConditionalGeneration of our (Qwen3.5-family) config, every
    parameter randomised (A_log in (-1, 1): decays neither vanishing nor exploding)."""
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    hf_cfg = Qwen3_5MoeConfig(**cfg.to_hf("float32"))
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(hf_cfg).eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-1, 1) if "A_log" in name else p.normal_(std=0.1)
    return model
