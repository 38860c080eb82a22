"""One-device training step: LoRA adapters vs full fine-tuning of the same model.

Legend: r rank, D hidden, E experts, K top-k, F expert hidden, B batch, S sequence.

    python bench/lora_step.py                          # CPU: the tiny preset, fp32
    python bench/lora_step.py --preset 30b --layers 4 --seq 4096 --dtype bf16   # GPU

Design choices:
- Same model, same process: the full fine-tuning model is built from seed 0; the LoRA model is a
  copy of it with adapters attached (moevlm.model.lora.attach_lora: every base weight frozen) on
  --modules (default attention, dense MLPs and experts, the expert pairs through the grouped GEMM)
  at rank --rank.  B starts at zero, so before timing the two first losses must be equal (relative
  1e-5 in fp32, 1e-2 in bf16): the adapters change nothing yet.
- A step is forward + backward + AdamW (torch's, foreach, fp32 or --dtype state) over the trainable
  parameters; text-only tokens (the vision tower is frozen-or-adapted alike in both).
- Timing: a warm-up step each (it makes the optimizer state), then the two interleaved, median of
  --iters, so load drift on a shared machine hits both alike.
- Memory: CPU counts tracked storages (moevlm.plan.fake.StorageTracker, the planner's counter: the
  weights, the optimizer state and what the step allocates, at the step's peak); CUDA reads
  torch.cuda.max_memory_allocated over the step, less the other model's resident bytes.
- Trainable parameters and optimizer bytes are counted on the tensors (numel x itemsize).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.config import LoraConfig
from moevlm.model.linear import is_adapter
from moevlm.model.lora import attach_lora
from moevlm.train.metrics import describe_device


def config(preset: str, layers: int, experts: int = 0) -> VLMConfig:
    """The preset with fewer decoder layers or experts (0: the preset's)."""
    cfg = VLMConfig.preset("tiny" if preset == "tiny" else "qwen3_vl_30b_a3b")
    t = cfg.text
    cfg = dataclasses.replace(
        cfg,
        text=dataclasses.replace(t, num_layers=layers or t.num_layers),
        moe=dataclasses.replace(cfg.moe, num_experts=experts or cfg.moe.num_experts),
        attn_backend="sdpa",
    )
    cfg.moe.grouped_gemm = "torch"
    return cfg


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Side:
    """One model, its AdamW over its trainable parameters, its measurements."""

    def __init__(self, name: str, model, lr: float = 1e-4):
        self.name, self.model = name, model
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trainable, lr=lr, foreach=True)
        self.times: list[float] = []
        self.peak = 0

    def step(self, ids, labels) -> float:
        out = self.model(ids, labels=labels)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    def resident(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return list(self.model.parameters()) + state

    def optimizer_bytes(self) -> int:
        return nbytes(t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t))

    def measure_peak(self, ids, labels, device: torch.device) -> None:
        """Bytes at the step's peak: this model's weights and optimizer state, and what the step makes."""
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            others = torch.cuda.memory_allocated() - nbytes(self.resident())
            self.step(ids, labels)
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - others
            return
        from moevlm.plan.fake import StorageTracker

        mem = StorageTracker()
        mem.track(self.resident())
        with mem:
            self.step(ids, labels)
        self.peak = mem.peak_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=["tiny", "30b"], default="tiny")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0: the preset's)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (a multiple of 8)")
    ap.add_argument(
        "--modules", default="attn,mlp,experts", help="model.lora_modules, comma-separated"
    )
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    cfg = config(a.preset, a.layers, a.experts)
    torch.manual_seed(0)
    with torch.device(device):
        full = Qwen3VLMoe(cfg)
        lora = copy.deepcopy(full)
        attach_lora(lora, LoraConfig(rank=a.rank, modules=tuple(a.modules.split(","))))
    lora.init_weights(only=is_adapter)  # A uniform, B zero
    full.to(dtype)
    lora.to(dtype)
    sides = [Side("full", full), Side(f"LoRA r={a.rank}", lora)]
    ids = torch.randint(
        0, min(cfg.image_token_id, cfg.vision_start_token_id, 1000), (a.batch, a.seq), device=device
    )
    labels = ids.clone()
    first = [s.step(ids, labels) for s in sides]  # the warm-up: makes the optimizer state
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert abs(first[1] - first[0]) <= tol * abs(first[0]), first
    for s in sides:
        s.measure_peak(ids, labels, device)
    for _ in range(a.iters):
        for s in sides:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.step(ids, labels)
            if device.type == "cuda":
                torch.cuda.synchronize()
            s.times.append(time.perf_counter() - t0)
    t = cfg.text
    print(
        f"device: {describe_device(device)}, torch {torch.__version__}; {a.preset}: {t.num_layers} layers, "
        f"D={t.hidden_size}, E={cfg.moe.num_experts}, K={cfg.moe.top_k}, F={cfg.moe.moe_intermediate_size}; "
        f"B={a.batch} S={a.seq} {a.dtype}; LoRA on {a.modules}; median of {a.iters}"
    )
    base, ours = sides
    rows = [
        ("step ms", lambda s: statistics.median(s.times) * 1e3, "{:.2f}"),
        ("trainable parameters", lambda s: sum(p.numel() for p in s.trainable), "{:,}"),
        ("optimizer MiB", lambda s: s.optimizer_bytes() / 2**20, "{:.3f}"),
        ("peak MiB", lambda s: s.peak / 2**20, "{:.2f}"),
    ]
    print(f"| figure | {base.name} | {ours.name} | LoRA/full |")
    print("|---|---:|---:|---:|")
    for label, fig, fmt in rows:
        b, o = fig(base), fig(ours)
        print(f"| {label} | {fmt.format(b)} | {fmt.format(o)} | {o / b:.4f} |")


if __name__ == "__main__":
    main()
