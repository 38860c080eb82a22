"""Tiny Qwen3-VL-MoE on CPU: our model vs the Hugging Face reference
(transformers Qwen3VLMoeForConditionalGeneration), same weights, same input.

Legend: B batch (1), S sequence, N patches, D patch dim, I images.

    python bench/model_vs_hf.py [--seq 512] [--iters 10] [--threads 2]

Losses are compared before timing; runs are interleaved (ours, HF, ...) and the median reported.
"forward" is under no_grad, "fwd+bwd" the training step's loss and its backward; ours is timed for
each grouped GEMM ("torch", "loop").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch
import transformers

from moevlm.model import Qwen3VLMoe, VLMConfig

GRIDS = [(1, 8, 8), (1, 8, 12)]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0]} ({len(names)} logical CPUs)" if names else "unknown CPU"


def make_input(cfg: VLMConfig, seq: int, g: torch.Generator):
    """text, [<vision_start>, image tokens, <vision_end>, text] per image; S = seq."""
    n_img = [t * h * w // cfg.vision.spatial_merge_size**2 for t, h, w in GRIDS]
    n_text = seq - sum(n_img) - 2 * len(GRIDS)
    if n_text < len(GRIDS) + 1:
        raise SystemExit(
            f"--seq {seq} is too short for grids {GRIDS}; use at least {seq - n_text + len(GRIDS) + 1}"
        )
    text_lens = [n_text // (len(GRIDS) + 1)] * len(GRIDS) + [
        n_text - n_text // (len(GRIDS) + 1) * len(GRIDS)
    ]
    parts = [torch.randint(0, 1000, (text_lens[0],), generator=g)]
    for n, tl in zip(n_img, text_lens[1:]):
        parts += [
            torch.tensor([cfg.vision_start_token_id]),
            torch.full((n,), cfg.image_token_id),
            torch.tensor([cfg.vision_end_token_id]),
            torch.randint(0, 1000, (tl,), generator=g),
        ]
    input_ids_BS = torch.cat(parts)[None]
    grid_I3 = torch.tensor(GRIDS)
    pixels_ND = torch.randn(int(grid_I3.prod(-1).sum()), cfg.vision.patch_dim, generator=g)
    return input_ids_BS, pixels_ND, grid_I3


def build(cfg: VLMConfig, tmp: str):
    """(HF reference, {grouped_gemm: ours}) sharing the reference's weights."""
    torch.manual_seed(0)
    hf = transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(**cfg.to_hf("float32"))
    )
    hf.config._attn_implementation = "sdpa"
    hf.save_pretrained(tmp)
    ours = {
        gg: Qwen3VLMoe.from_pretrained(
            tmp, attn_backend="sdpa", moe=dataclasses.replace(cfg.moe, grouped_gemm=gg)
        )
        for gg in ("torch", "loop")
    }
    return hf, ours


def loss_fn(model, batch, is_hf: bool):
    """A closure computing the training loss (LM + router aux) on `batch`."""
    input_ids_BS, pixels_ND, grid_I3 = batch
    if not is_hf:
        return lambda: model(input_ids_BS, pixels_ND, grid_I3, labels=input_ids_BS).loss
    kw = dict(
        input_ids=input_ids_BS,
        pixel_values=pixels_ND,
        image_grid_thw=grid_I3,
        labels=input_ids_BS,
        mm_token_type_ids=(input_ids_BS == model.config.image_token_id).int(),
        output_router_logits=True,
    )
    return lambda: model(**kw).loss


def passes(model, loss):
    """(forward-only, forward+backward) callables for one model."""

    def fwd():
        with torch.no_grad():
            loss()

    def fwd_bwd():
        loss().backward()
        model.zero_grad(set_to_none=True)

    return fwd, fwd_bwd


def time_interleaved(fns: dict, iters: int, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds per callable, calls interleaved round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ms = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ms[k].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in ms.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512, help="total tokens (text + image)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    cfg = VLMConfig.preset("tiny")
    batch = make_input(cfg, args.seq, torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build(cfg, tmp)
    models = {"hf": hf, **{f"ours[{gg}]": m for gg, m in ours.items()}}
    for m in models.values():
        m.train()
    losses = {k: loss_fn(m, batch, k == "hf") for k, m in models.items()}
    print(
        f"device: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__} (experts={hf.config.text_config._experts_implementation})"
    )
    check_same_loss(losses, batch)
    closures = {k: passes(models[k], fn) for k, fn in losses.items()}
    fwd = time_interleaved({k: c[0] for k, c in closures.items()}, args.iters)
    fwd_bwd = time_interleaved({k: c[1] for k, c in closures.items()}, args.iters)
    print(f"\n{'pass':<8} {'grouped_gemm':<13} {'ours ms':>9} {'HF ms':>9} {'HF/ours':>8}")
    for name, res in (("forward", fwd), ("fwd+bwd", fwd_bwd)):
        for gg in ours:
            o, h = res[f"ours[{gg}]"], res["hf"]
            print(f"{name:<8} {gg:<13} {o:9.2f} {h:9.2f} {h / o:7.2f}x")


def check_same_loss(losses: dict, batch) -> None:
    """Refuse to time models that do not compute the same loss."""
    with torch.no_grad():
        values = {k: fn().item() for k, fn in losses.items()}
    print(
        f"input: S={batch[0].shape[1]} tokens, grids {GRIDS} ({batch[1].shape[0]} patches); loss "
        + ", ".join(f"{k} {v:.6f}" for k, v in values.items())
    )
    worst = max(abs(v - values["hf"]) / abs(values["hf"]) for v in values.values())
    if worst > 1e-4:
        raise SystemExit(f"losses differ by {worst:.2e} (relative); not timing different functions")


if __name__ == "__main__":
    main()
