"""Host time of one training step at a recipe's real size with no compute: moevlm vs transformers
and torchtitan on the same decoder shape, layers, tokens and rows.

    python bench/host_time.py [--experiment h100_1gpu] [--layers 4 8] [--json PATH]

Every step (forward, loss, backward, clip, AdamW step, zero_grad) runs on fake CPU tensors under
one mode (moevlm.plan.fake.PlanMode: the dry run's, which keeps small integer values and balances
routing); fake CUDA cannot run a backward on a CPU-only torch.  Host ms: median of --repeats after
one warm-up step; aten ops: counted above the fake mode; per layer: the difference between the two
depths.  torchtitan is imported from --titan-site DIR (its install: TITAN_HOW below).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moevlm.config import compose_job, validate
from moevlm.plan import dry_run
from moevlm.plan.environments import emulated_autocast
from moevlm.plan.fake import PlanMode

CPU = torch.device("cpu")
TITAN_HOW = (
    "pip install --no-deps --target DIR torchtitan==0.3.0 tyro docstring-parser spmd-types, "
    "then --titan-site DIR"
)


class OpCounter(TorchDispatchMode):
    """aten ops dispatched (entered above the fake mode: every op the step issues), by part: the
    backward's (inside autograd's graph task), the update's (under `OpCounter.update`: clip, AdamW,
    zero_grad) and the forward's (the rest: forward and loss)."""

    updating = False

    def __init__(self):
        super().__init__()
        self.parts = {"fwd": 0, "bwd": 0, "update": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.prim.device.default:
            bwd = torch._C._current_graph_task_id() != -1
            self.parts["bwd" if bwd else "update" if OpCounter.updating else "fwd"] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    @contextlib.contextmanager
    def update():
        OpCounter.updating = True
        try:
            yield
        finally:
            OpCounter.updating = False


def _dtype(job):
    return torch.bfloat16 if dry_run._bf16(job) else None


def moevlm_step(job, mode: PlanMode):
    """The trainer's step (moevlm.train.trainer: forward with the MicroBatch's forward_kwargs, the
    objective, backward, finish_gradients, clip, AdamW) on the dry run's model and budget batch."""
    from moevlm.data.batch import MicroBatch
    from moevlm.model.objective import objective
    from moevlm.parallel.build import materialize_
    from moevlm.train.optim import build_optimizer

    plan = validate(job, 1, environment=False)
    real = dry_run.budget_micro_batch(job, plan.model)
    model, ctx = dry_run._build(job, plan, "cpu", dry_run._bf16(job))  # on meta, as the dry run
    with mode:
        materialize_(model, CPU, ctx)
        opt = build_optimizer(model, job.optim)
        fields = {k: dry_run._placed(mode, k, v, CPU) for k, v in real.model_inputs().items()}
    mb = MicroBatch(**fields, **{k: getattr(real, k) for k in dry_run._COUNTS})
    coef, clip = plan.model.moe.router_aux_loss_coef, job.optim.grad_clip or float("inf")

    def step():
        with emulated_autocast("cpu", _dtype(job)):
            out = model(**mb.forward_kwargs())
        lm_sum = out.lm_loss * out.num_loss_tokens
        objective(lm_sum, float(real.loss_tokens), out.aux_loss, coef, 1).backward()
        with OpCounter.update():
            ctx.finish_gradients()
            ctx.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def _tokens(job, vocab: int):
    rows_S, gen = (job.train.micro_batch_size, job.data.pack.seq_len), torch.Generator()
    return torch.randint(0, min(vocab, 1000), rows_S, generator=gen.manual_seed(0))


def _adamw_step(model, job):
    """The usual loop's tail, as transformers' Trainer and torchtitan run it: fused AdamW, clip."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=job.optim.lr, fused=True)
    clip = job.optim.grad_clip or float("inf")

    def tail(loss_value):
        loss_value.backward()
        with OpCounter.update():
            params = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return tail


def transformers_step(job, mode: PlanMode):
    """transformers' Qwen3VLMoeForConditionalGeneration from our config (its default sdpa attention
    and grouped_mm experts), forward with labels (router logits with the recipe's aux loss)."""
    import transformers

    cfg = validate(job, 1, environment=False).model
    hf_cfg = transformers.Qwen3VLMoeConfig(**cfg.to_hf("float32"))
    ids = _tokens(job, cfg.text.vocab_size)
    with mode:
        model = transformers.Qwen3VLMoeForConditionalGeneration(hf_cfg).train()
        x = mode.fake(ids, CPU)
        tail = _adamw_step(model, job)
    aux = cfg.moe.router_aux_loss_coef > 0

    def step():
        with emulated_autocast("cpu", _dtype(job)):
            loss = model(input_ids=x, labels=x, output_router_logits=aux).loss
        tail(loss)

    return step


def titan_config(job):
    """torchtitan's Qwen3 MoE config at this job's decoder sizes, made as its 30B-A3B flavour makes
    its own (torchtitan.models.qwen3._30b_a3b: the same helpers, flex attention)."""
    from torchtitan.models import qwen3 as q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    cfg = validate(job, 1, environment=False).model
    t, m, D, V = cfg.text, cfg.moe, cfg.text.hidden_size, cfg.text.vocab_size
    rope = CosSinRoPE.Config(dim=t.head_dim, max_seq_len=job.data.pack.seq_len, theta=t.rope_theta)
    # fmt: off
    layers = q._build_qwen3_moe_layers(
        n_layers=t.num_layers, dim=D, n_heads=t.num_heads, n_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, moe_hidden_dim=m.moe_intermediate_size, num_experts=m.num_experts,
        top_k=m.top_k, attn_backend="flex", rope=rope, moe_comm_backend="standard")
    return q.Qwen3Model.Config(
        vocab_size=V, dim=D, norm=q._qwen3_norm(D), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
        lm_head=Linear.Config(in_features=D, out_features=V))
    # fmt: on


def titan_step(job, mode: PlanMode):
    """torchtitan's Qwen3 MoE (local token dispatcher, torch._grouped_mm experts, the block-causal
    document mask made each step as its trainer does), summed cross entropy over the tokens.
    Changed to run on CPU: create_block_mask runs eagerly (torchtitan compiles it; Inductor cannot
    build for fake tensors) and flex attention, which has no CPU backward, is causal SDPA (exact
    here: one document per row)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.common import attention

    def sdpa(q, k, v, *, block_mask, scale, enable_gqa, **_):
        causal = dict(is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **causal), None

    attention.FlexAttention.compiled_flex_attn = staticmethod(sdpa)
    attention._compiled_create_block_mask = create_block_mask
    config = titan_config(job)
    ids = _tokens(job, config.vocab_size)
    positions = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
    with mode:
        model = config.build()
        x, pos = mode.fake(ids, CPU), mode.fake(positions, CPU)
        tail = _adamw_step(model, job)

    def step():
        masks = model.get_attention_masks(pos)
        with emulated_autocast("cpu", _dtype(job)):
            logits = model(x, pos, masks)
        tail(cross_entropy_loss(logits, x) / ids.numel())

    return step


def measure(make_step, job, repeats: int) -> dict:
    """Host ms (median) and aten ops of a step, after a warm-up step that makes the AdamW state."""
    with dry_run._one_thread():  # as the dry run: one thread for the small host values
        mode = PlanMode()
        step = make_step(job, mode)
        with mode:
            step()
            with OpCounter() as ops:
                step()
            ms = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                ms.append(1e3 * (time.perf_counter() - t0))
    return {"ms": statistics.median(ms), "ops": sum(ops.parts.values()), "parts": ops.parts}


FRAMEWORKS = {"moevlm": moevlm_step, "transformers": transformers_step, "torchtitan": titan_step}


def titan_missing(site: str | None) -> str | None:
    """Why torchtitan cannot be imported (None when it can), --titan-site tried first."""
    sys.path += [site] if site and site not in sys.path else []
    try:
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as e:
        return f"torchtitan not installed ({e}): {TITAN_HOW}"


def run(jobs: dict[int, object], frameworks=tuple(FRAMEWORKS), repeats: int = 3) -> dict:
    """{framework: {"ms"/"ops"/"parts": {layers: figure}} or {"na": why}} for each job (by its
    decoder depth), frameworks in the given order."""
    out = {}
    for name in frameworks:
        try:
            rows = {n: measure(FRAMEWORKS[name], job, repeats) for n, job in jobs.items()}
        except Exception as e:  # a framework that cannot run this step here: said, not invented
            out[name] = {"na": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        out[name] = {k: {n: r[k] for n, r in rows.items()} for k in ("ms", "ops", "parts")}
    return out


def per_layer(values: dict) -> float:
    (a, va), (b, vb) = sorted(values.items())[0], sorted(values.items())[-1]
    return (vb - va) / (b - a)


COLUMNS = ("framework", "host ms/step", "ms/layer", "aten ops/step", "fwd / bwd / update",
           "ops/layer", "ratio to moevlm (ms, ops)")  # fmt: skip


def table(results: dict, depth: int) -> str:
    """Markdown at `depth` decoder layers: per framework host ms/step and per layer, aten ops/step
    (forward / backward / update) and per layer, and the ratios to moevlm's."""
    rows = [COLUMNS, ["---"] * len(COLUMNS)]
    base = results.get("moevlm", {}).get("ms") and results["moevlm"]
    for name, r in results.items():
        if "na" in r:
            rows.append([name, f"n/a: {r['na']}"] + [""] * 5)
            continue
        ms, ops, parts = r["ms"][depth], r["ops"][depth], r["parts"][depth].values()
        ratio = f"{ms / base['ms'][depth]:.2f}x, {ops / base['ops'][depth]:.2f}x" if base else ""
        per = [f"{per_layer(r[k]):.0f}" for k in ("ms", "ops")]
        rows.append([name, f"{ms:.0f}", per[0], ops, " / ".join(map(str, parts)), per[1], ratio])
    return "\n".join("| " + " | ".join(map(str, row)) + " |" for row in rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="h100_1gpu")
    ap.add_argument("--layers", type=int, nargs=2, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", action="store_true", help="moevlm also with the recipe's image")
    ap.add_argument("--titan-site", default=None, help="a folder torchtitan is installed in")
    ap.add_argument("--json", default=None, help="save the figures to this file")
    args = ap.parse_args(argv)
    base = [f"+experiment={args.experiment}", "data.shards=sample"]
    depths = [f"model.num_layers={n}" for n in args.layers]
    text = {
        n: compose_job([*base, d, "data.pack.max_patches=0"]) for n, d in zip(args.layers, depths)
    }
    missing = titan_missing(args.titan_site)
    results = run(text, [n for n in FRAMEWORKS if n != "torchtitan" or not missing], args.repeats)
    results |= {"torchtitan": {"na": missing}} if missing else {}
    if args.images:
        jobs = {n: compose_job([*base, d]) for n, d in zip(args.layers, depths)}
        results["moevlm, image"] = run(jobs, ["moevlm"], args.repeats)["moevlm"]
    depth = max(args.layers)
    seq = text[depth].data.pack.seq_len
    print(
        f"{args.experiment}, {depth} decoder layers, rows of {seq} tokens, {args.repeats} repeats"
    )
    print(table(results, depth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"experiment": args.experiment, "layers": args.layers, **results}, f)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
