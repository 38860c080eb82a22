"""End-to-end training steps on one device: our trainer vs Hugging Face
transformers' model of the same family (Qwen3VLMoe- or Qwen3_5MoeForConditionalGeneration) on the same samples, then our
trainer on real vs mock data (data.mock=image_free, random_pixels).

Legend: B samples of a micro-batch (HF's padded batch), L the longest of them.

    python bench/e2e.py --preset tiny [--smoke] [OVERRIDE ...]       # CPU, fp32
    python bench/e2e.py --preset qwen3_5_tiny [--smoke]              # CPU, fp32, the Qwen3.5-MoE family
    python bench/e2e.py --preset h100_1gpu [OVERRIDE ...]            # one 80 GB GPU, bf16
    python bench/e2e.py --preset tiny model.recompute=selective train.compile=true

Design choices:
- Ours is the trainer itself (moevlm.train.trainer.Trainer, the config composed
  like train.py's from the preset's overrides and the extra ones given here),
  stepped with `train_step`: whatever the config turns on (recompute, compile,
  precision, grouped GEMM) is what is measured.  One step = one micro-batch
  (train.global_batch_size is set to train.micro_batch_size).
- HF is built from our initial weights (moevlm.parallel.hf_io.save_hf, then
  `from_pretrained`, sdpa attention, its default experts implementation), in
  the same process, with the same precision policy (fp32 weights, bf16 autocast
  when the trainer uses it), torch AdamW with the same settings and the same
  gradient clipping: a step is forward + backward + clip + AdamW for both.
- Same samples, same useful tokens: the rows our loader packed are unpacked
  into their documents (cu_seqlens) and images (each document takes as many
  images as its <|image_pad|> tokens need) and given to HF as a right-padded
  batch with attention_mask, mm_token_type_ids, image_grid_thw and only the
  real patches.  Before timing, the LM losses of both on the first micro-batch
  must agree (relative 1e-3 in fp32, 3e-2 in bf16; on CUDA ours is measured
  before its steps and HF before its own): no ratio of two different
  functions is printed.
- Ours vs HF is compute only: the micro-batches are fetched before the clock
  starts.  Real vs mock is the whole training step as train.py runs it, data
  wait included (each mode has its own loader with the preset's workers), so
  the decode cost that mock data hides shows; the data-wait share is printed.
- Timing: warm-up steps first, then the median step; on CPU the runs are
  interleaved (ours, HF, real, image_free, random_pixels, ours, ...) so load
  drift on a shared machine hits all alike.  On CUDA two copies of a large
  proxy do not fit, so ours (real and mock modes interleaved on one model) runs
  first, is freed, and HF runs after; peak memory is per side then
  (torch.cuda.max_memory_allocated over its steps), n/a on CPU.
- Denormals are flushed to zero (torch.set_flush_denormal, CPU arithmetic
  only): after some dozens of AdamW steps the tiny model's CPU steps, ours and
  HF's alike, slowed ~5x from denormal arithmetic (measured: a 20-step run took
  4 min instead of 19 s), which would measure the CPU's denormal path, not
  either implementation.
- Tokens/s counts useful tokens (padding excluded), TFLOP/s and MFU count the
  model FLOPs of the real documents and images (moevlm.model.count_flops,
  vision tower included, training = 3x forward); both sides are credited the
  same FLOPs for the same samples, whatever padding HF computes.  MFU is n/a
  where the device's peak is unknown (CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moevlm.config import compose_job
from moevlm.data.batch import row_flops
from moevlm.data.loader import build_loader
from moevlm.data.text import IGNORE_INDEX
from moevlm.parallel.hf_io import save_hf
from moevlm.train.metrics import Window, device_name, device_peak_tflops
from moevlm.train.trainer import Trainer

# the sample set's tokenizer ids (moevlm.data.text.TINY_SPECIAL_IDS), taken by a random-init proxy
SAMPLE_IDS = [
    "model.image_token_id=1020",
    "model.video_token_id=1021",
    "model.vision_start_token_id=1018",
    "model.vision_end_token_id=1019",
]
# preset -> (overrides, warm-up steps, timed steps); --smoke: 1 warm-up, 2 timed
PRESETS = {
    "tiny": (["train.precision=fp32", "train.device=cpu", "data.num_workers=1"], 2, 8),
    # the Qwen3.5-MoE family (Gated DeltaNet + gated attention + shared expert) at CPU size
    "qwen3_5_tiny": (
        [
            "model.preset=qwen3_5_tiny",
            "train.precision=fp32",
            "train.device=cpu",
            "data.num_workers=1",
        ],
        2,
        8,
    ),
    "h100_1gpu": (
        ["+experiment=h100_1gpu", "data.shards=sample", *SAMPLE_IDS, "data.num_workers=4"],
        3,
        10,
    ),
}
MOCKS = ("image_free", "random_pixels")


class Rows:
    """A loader over rows fetched beforehand (the trainer's `loader` interface): compute-only steps."""

    def __init__(self, rows: list[dict]):
        self.rows, self.wait_s = list(rows), 0.0

    def __next__(self) -> dict:
        return self.rows.pop(0)

    def stats(self) -> dict:
        return {"skipped": {}, "skipped_total": 0, "data_wait_s": 0.0}

    def close(self) -> None:
        pass


def compose(preset: str, extra: list[str], run_dir: str):
    overrides, warmup, iters = PRESETS[preset]
    job = compose_job(
        overrides
        + [
            f"train.run_dir={run_dir}",
            "train.steps=100000",
            "train.tensorboard=false",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.log_every=1000000",
            "train.require_loss_decrease=false",
            "train.resume=none",
        ]
        + extra
    )
    job.train.global_batch_size = job.train.micro_batch_size  # one micro-batch per step
    return job, warmup, iters


def unpack(rows: list[dict], image_token_id: int, merge: int) -> list[dict]:
    """Packed rows -> their samples: ids, labels, the images' grids and patches, in order."""
    samples = []
    for r in rows:
        cu = r["cu_seqlens"][: r["num_samples"] + 1].tolist()
        grids = r["image_grid_thw"][: r["num_images"]].tolist()
        img, patch = 0, 0
        for a, b in zip(cu, cu[1:]):
            ids = r["input_ids"][0, a:b]
            need, mine = int((ids == image_token_id).sum()), []
            while need > 0:
                mine.append(grids[img])
                need -= grids[img][0] * grids[img][1] * grids[img][2] // merge**2
                img += 1
            n = sum(t * h * w for t, h, w in mine)
            samples.append(
                {
                    "ids": ids,
                    "labels": r["labels"][0, a:b],
                    "grids": mine,
                    "pixels": r["pixel_values"][patch : patch + n],
                }
            )
            patch += n
        if img != r["num_images"] or patch != r["useful_patches"]:
            raise RuntimeError(
                f"unpacking a row used {img} of {r['num_images']} images and {patch} of "
                f"{r['useful_patches']} patches: the row's image tokens do not match its grids"
            )
    return samples


def hf_batch(samples: list[dict], image_token_id: int, device) -> dict:
    """The samples as one right-padded batch for transformers (B, L)."""
    B, L = len(samples), max(s["ids"].numel() for s in samples)
    ids_BL = torch.zeros(B, L, dtype=torch.long)
    labels_BL = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
    mask_BL = torch.zeros(B, L, dtype=torch.long)
    for i, s in enumerate(samples):
        n = s["ids"].numel()
        ids_BL[i, :n], labels_BL[i, :n], mask_BL[i, :n] = s["ids"], s["labels"], 1
    out = {
        "input_ids": ids_BL,
        "labels": labels_BL,
        "attention_mask": mask_BL,
        "mm_token_type_ids": (ids_BL == image_token_id).int(),
    }
    grids = [g for s in samples for g in s["grids"]]
    if grids:
        out["pixel_values"] = torch.cat([s["pixels"] for s in samples if s["grids"]])
        out["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
    return {k: v.to(device) for k, v in out.items()}


class HFSide:
    """transformers' model with torch AdamW: forward + backward + clip + step on a padded batch."""

    def __init__(self, hf_dir: str, job, device, bf16: bool):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        family = json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
        cls = {
            "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
            "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
        }[family]
        self.model = cls.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        self.model.train()
        o = job.optim
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.clip = job.optim.grad_clip
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if bf16
            else contextlib.nullcontext
        )
        self.experts = getattr(self.model.config.text_config, "_experts_implementation", "default")

    def lm_loss(self, batch: dict) -> float:
        with torch.no_grad(), self.autocast():
            out = self.model(**batch, output_router_logits=True)
        coef = self.model.config.text_config.router_aux_loss_coef
        return (
            float(out.loss - coef * out.aux_loss) if out.aux_loss is not None else float(out.loss)
        )

    def step(self, batch: dict) -> None:
        with self.autocast():
            loss = self.model(**batch, output_router_logits=True).loss
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Timer:
    """Step times (s), tokens, FLOPs, data wait and peak memory of one measured side."""

    def __init__(self, device):
        self.device, self.s, self.wait, self.tokens, self.flops, self.mem = (
            device,
            [],
            [],
            [],
            [],
            [],
        )

    @contextlib.contextmanager
    def step(self, timed: bool):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        if timed:
            self.s.append(time.perf_counter() - t0)
            if cuda:
                self.mem.append(torch.cuda.max_memory_allocated() / 2**30)

    def add(self, tokens: float, flops: float, wait: float = 0.0) -> None:
        if len(self.tokens) < len(self.s):
            self.tokens.append(tokens)
            self.flops.append(flops)
            self.wait.append(wait)

    def row(self, peak: float | None) -> dict:
        s = statistics.median(self.s)
        total = sum(self.s)
        tflops = sum(self.flops) / total / 1e12
        return {
            "ms": 1e3 * s,
            "tokens_s": sum(self.tokens) / total,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "mem": max(self.mem) if self.mem else None,
            "wait": sum(self.wait) / total,
        }


def ours_step(tr: Trainer, timer: Timer, timed: bool) -> None:
    w = Window()
    with timer.step(timed):
        tr.train_step(w)
    timer.add(w.tokens, w.flops, w.wait)


def fetch(tr: Trainer, n: int) -> list[list[dict]]:
    """n micro-batches of train.micro_batch_size rows from the trainer's (real) loader."""
    return [[next(tr.loader) for _ in range(tr.t.micro_batch_size)] for _ in range(n)]


def ours_lm_loss(tr: Trainer, rows: list[dict]) -> float:
    tr.loader = Rows(rows)
    mb = tr._micro_batch()
    with torch.no_grad(), tr._autocast():
        return float(tr.model(**mb.to(tr.device).model_inputs()).lm_loss)


def compare_losses(ours: float, theirs: float, bf16: bool) -> str:
    tol = 3e-2 if bf16 else 1e-3
    rel = abs(ours - theirs) / abs(theirs)
    if rel > tol:
        raise SystemExit(
            f"LM losses differ on the same samples: ours {ours:.6f}, HF {theirs:.6f} (relative "
            f"{rel:.1e} > {tol}); not timing different functions"
        )
    return f"LM loss on one micro-batch before any step: ours {ours:.6f}, HF {theirs:.6f} (relative {rel:.1e})"


def run(args) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="e2e-")
    job, warmup, iters = compose(args.preset, args.overrides, str(Path(tmp.name) / "run"))
    if args.smoke:
        warmup, iters = 1, 2
    warmup, iters = args.warmup if args.warmup is not None else warmup, args.iters or iters
    tr = Trainer(job)
    dev, bf16, cfg = tr.device, tr.plan.build.bf16, tr.plan.model
    merge, image_id = cfg.vision.spatial_merge_size, cfg.image_token_id
    peak = device_peak_tflops(dev, "bf16" if bf16 else "fp32", job.train.peak_tflops)
    hf_dir = str(Path(tmp.name) / "hf")
    save_hf(tr.model, hf_dir)  # the initial weights, before any step
    n = warmup + iters
    micro = fetch(tr, n + 1)  # +1: the loss check
    flops = [sum(row_flops(r, cfg, job.model.freeze_vision) for r in rows) for rows in micro]
    tokens = [sum(r["useful_tokens"] for r in rows) for rows in micro]
    hf_in = [hf_batch(unpack(rows, image_id, merge), image_id, dev) for rows in micro]
    real = tr.loader
    mocks = {
        m: build_loader(
            dataclasses.replace(real.cfg, mock=m), cfg, hf_checkpoint=job.model.hf_checkpoint
        )
        for m in MOCKS
    }
    loaders = {"real": real, **mocks}
    timers = {k: Timer(dev) for k in ("ours", "hf", *loaders)}
    interleave = dev.type == "cpu"
    hf = HFSide(hf_dir, job, dev, bf16) if interleave else None
    ours_loss = ours_lm_loss(tr, micro[n])  # initial weights, as HF's
    notes = [compare_losses(ours_loss, hf.lm_loss(hf_in[n]), bf16)] if hf else []

    def ours_on(i):
        tr.loader = Rows(micro[i])
        with timers["ours"].step(i >= warmup):
            tr.train_step(Window())
        timers["ours"].add(tokens[i], flops[i])

    def hf_on(i):
        with timers["hf"].step(i >= warmup):
            hf.step(hf_in[i])
        timers["hf"].add(tokens[i], flops[i])

    def data_on(i):
        for mode, loader in loaders.items():
            tr.loader = loader
            ours_step(tr, timers[mode], i >= warmup)

    for i in range(n):
        ours_on(i)
        if interleave:
            hf_on(i)
        data_on(i)
    experts = hf.experts if hf else None
    if not interleave:  # CUDA: ours freed, then HF alone
        for loader in loaders.values():
            loader.close()
        tr.close()
        del tr, real, loaders, mocks
        gc.collect()
        torch.cuda.empty_cache()
        hf = HFSide(hf_dir, job, dev, bf16)
        experts = hf.experts
        # before HF's first step
        notes.append(compare_losses(ours_loss, hf.lm_loss(hf_in[n]), bf16))
        for i in range(n):
            hf_on(i)
    else:
        for loader in loaders.values():
            loader.close()
        tr.close()
    tmp.cleanup()
    rows = {k: t.row(peak) for k, t in timers.items()}
    head = (
        f"device: {device_label(dev)}, torch {torch.__version__}, transformers {_tf_version()} "
        f"(HF experts: {experts}); preset {args.preset}{' --smoke' if args.smoke else ''}"
        f"{' ' + ' '.join(args.overrides) if args.overrides else ''}; {'bf16 autocast' if bf16 else 'fp32'}, "
        f"micro-batch {job.train.micro_batch_size} x seq_len {job.data.pack.seq_len} "
        f"(max_patches {job.data.pack.max_patches}); {warmup} warm-up + {iters} timed steps, "
        f"{'interleaved' if interleave else 'ours first, then HF'}"
    )
    return {"head": head, "notes": notes, "rows": rows}


def device_label(dev) -> str:
    if dev.type == "cuda":
        return device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"CPU {names[0]} ({torch.get_num_threads()} threads)"
    except OSError:
        return "CPU"


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def table(res: dict) -> str:
    r = res["rows"]
    lines = [
        res["head"],
        *res["notes"],
        "",
        "| side (same samples, compute only) | step ms | tokens/s | TFLOP/s | MFU | peak GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, name in (("ours", "ours (packed rows)"), ("hf", "HF transformers (padded batch)")):
        x = r[k]
        lines.append(
            f"| {name} | {x['ms']:.1f} | {x['tokens_s']:.0f} | {x['tflops']:.4f} | {_f(x['mfu'], '.3f')} | "
            f"{_f(x['mem'], '.2f')} |"
        )
    o, h = r["ours"], r["hf"]
    mem = f", peak memory HF/ours {h['mem'] / o['mem']:.2f}x" if o["mem"] and h["mem"] else ""
    ratios = (
        f"ours/HF: tokens/s {o['tokens_s'] / h['tokens_s']:.2f}x, TFLOP/s {o['tflops'] / h['tflops']:.2f}x, "
        f"step time HF/ours {h['ms'] / o['ms']:.2f}x{mem}"
    )
    lines += [
        "",
        ratios,
        "",
        "| ours, data (whole step, data wait included) | step ms | tokens/s | TFLOP/s | MFU | "
        "peak GiB | data wait | tokens/s vs real |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in ("real", *MOCKS):
        x = r[k]
        lines.append(
            f"| {k} | {x['ms']:.1f} | {x['tokens_s']:.0f} | {x['tflops']:.4f} | {_f(x['mfu'], '.3f')} | "
            f"{_f(x['mem'], '.2f')} | {100 * x['wait']:.1f}% | {x['tokens_s'] / r['real']['tokens_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="OVERRIDE: any train.py override (section.field=value), applied last",
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--smoke", action="store_true", help="1 warm-up and 2 timed steps (CI)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default: the preset's)")
    ap.add_argument("--iters", type=int, help="timed steps (default: the preset's)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # CPU math only; see the design choices
    print(table(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
