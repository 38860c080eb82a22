"""train.compile: per-block torch.compile (Inductor on the CPU) over the embedded real-image data matches
eager and never recompiles after step 1 (asserted from the dynamo counters in metrics.jsonl); the Triton
custom ops (interpreter) compile with fullgraph; the all-to-all dispatcher (ep2, 2 gloo ranks) keeps its
exchange out of the graph without recompiling on varying row counts.  Inductor builds its C++ kernels
scalar here (`_CHEAP_INDUCTOR`)."""

import json

import pytest
import torch
import torch._inductor.config
from gloo_ranks import run_ranks

from moevlm.config import compose_job, validate
from moevlm.dispatch import DispatcherSpec
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.compile import CompileCounters, apply_compile
from moevlm.train.trainer import Trainer

# What these tests check is the model's graphs (breaks, recompiles, parity with eager), which do not
# depend on how Inductor's CPU backend writes each fused kernel; g++ on the vectorized (AVX) kernels was
# most of the module's time (cold cache, bf16 MoE test: 50 s, 30 s scalar).  One compile thread: on two
# cores a pool of compile workers only adds its start-up.
_CHEAP_INDUCTOR = {"cpp.vec_isa_ok": False, "compile_threads": 1}

STEPS = 21
LOSS_RTOL = (
    1e-5  # fp32: Inductor's fused kernels reorder sums; measured max 1.5e-7 relative over 22 steps
)


@pytest.fixture(scope="module", autouse=True)
def _cheap_inductor():
    with torch._inductor.config.patch(_CHEAP_INDUCTOR):
        yield


def _run(tmp_path, compile_: bool) -> tuple[list[dict], Trainer]:
    run_dir = tmp_path / f"compile_{compile_}"
    job = compose_job(
        [
            "data.num_workers=1",
            "data.streams=1",
            "train.tensorboard=false",
            f"train.steps={STEPS}",
            "train.checkpoint_at_end=false",
            f"train.run_dir={run_dir}",
            f"train.compile={compile_}",
        ]
    )
    trainer = Trainer(job)
    assert trainer.run() == 0
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()], trainer


@pytest.mark.slow
def test_compiled_training_matches_eager_without_recompiles(tmp_path):
    compiled, trainer = _run(tmp_path, True)
    eager, _ = _run(tmp_path, False)
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    assert all(r["recompiles"] == 0 for r in compiled), [r["recompiles"] for r in compiled]
    assert compiled[0]["compiled_graphs"] > 0 and len({r["compiled_graphs"] for r in compiled}) == 1
    # fp32: the grouped GEMM seam only, found in step 1
    assert len({r["graph_breaks"] for r in compiled}) == 1
    assert "recompiles" not in eager[0]  # the keys come with train.compile
    for c, e in zip(compiled, eager):
        assert c["loss"] == pytest.approx(e["loss"], rel=LOSS_RTOL), c["step"]
    names = list(trainer.model.state_dict())  # checkpoints and HF export see the plain names
    assert "text.layers.0.self_attn.q_proj.weight" in names and not any(
        "_orig_mod" in n for n in names
    )


def test_compile_refuses_sdpa_per_doc():
    with pytest.raises(
        ConfigError, match="train.compile=true with model.attn_backend=sdpa_per_doc"
    ):
        validate(compose_job(["train.compile=true", "model.attn_backend=sdpa_per_doc"]))


def _text_batch(cfg, seed: int, S: int = 32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 900, (1, S), generator=g)
    # packer style, documents vary by seed
    cu = torch.tensor([0, 7 + seed % 5, 20, S, S], dtype=torch.int32)
    return dict(input_ids=ids, labels=ids, cu_seqlens=cu)


def _two_steps_beside_eager(eager, model, cfg, *, bf16: bool, rtol: float):
    """`model` compiled per block, two steps (forward, backward) beside `eager` on the same batches, the
    losses equal to `rtol`: (the compiled model, the compile counters after its first step)."""
    counters = CompileCounters()
    compiled = apply_compile(model, bf16=bf16)
    for step in range(2):
        batch = _text_batch(cfg, step)
        ref, out = eager(**batch), compiled(**batch)
        ref.loss.backward()
        out.loss.backward()
        torch.testing.assert_close(out.loss.float(), ref.loss.float(), rtol=rtol, atol=0)
        if step == 0:
            counters.warm()
    return compiled, counters.record()


def _eager_and_compiled(cfg, build):
    """Two copies of one model (same weights); the second compiled per block."""
    eager, compiled = build(cfg), build(cfg)
    compiled.load_state_dict(eager.state_dict())
    return eager, apply_compile(compiled, bf16=False)


@pytest.mark.slow
def test_triton_custom_ops_compile_fullgraph():
    """One tiny forward/backward with the Triton grouped GEMM and permute (custom ops with fakes, run in
    Triton's interpreter here): every layer compiles with fullgraph=True and matches eager."""
    pytest.importorskip("triton")
    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend, cfg.moe.grouped_gemm, cfg.moe.permute = "sdpa", "triton", "triton"
    cfg.text.num_layers, cfg.vision.depth, cfg.vision.deepstack_visual_indexes = (
        1,
        1,
        (),
    )  # the interpreter is slow
    eager, compiled = _eager_and_compiled(cfg, Qwen3VLMoe)
    batch = _text_batch(cfg, 0)
    ref, out = eager(**batch), compiled(**batch)
    ref.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    w = "text.layers.0.mlp.experts.gate_up_proj"
    torch.testing.assert_close(
        compiled.get_parameter(w).grad, eager.get_parameter(w).grad, rtol=1e-4, atol=1e-6
    )


def _ep2_alltoall(rank: int) -> None:
    with torch._inductor.config.patch(_CHEAP_INDUCTOR):  # the rank's own process
        _ep2_alltoall_checks(rank)


def _ep2_alltoall_checks(rank: int) -> None:
    from moevlm.parallel import ParallelDims, build_model, init_parameters_

    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"

    def build(cfg):
        model, ctx = build_model(
            cfg,
            ParallelDims(2, ep=2),
            BuildOptions(dp_mode="ddp", dispatcher=DispatcherSpec("alltoall")),
        )
        model.to_empty(device="cpu")
        init_parameters_(model, seed=1, ctx=ctx)
        return model

    eager, compiled = build(cfg), build(cfg)
    apply_compile(compiled, bf16=False)
    counters, rows = CompileCounters(), set()
    for step in range(3):  # different tokens each step: the expert row counts differ
        batch = _text_batch(cfg, 10 * step + rank)
        ref, out = eager(**batch), compiled(**batch)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
        out.loss.backward()
        rows.add(tuple(out.expert_counts.flatten().tolist()))
        if step == 0:
            counters.warm()
    c = counters.record()
    # dispatch and combine run outside the graph
    assert c["recompiles"] == 0 and c["graph_breaks"] >= 2, c
    assert len(rows) == 3  # the routing (hence the exchanged row counts) really varied


@pytest.mark.slow
def test_ep2_alltoall_exchange_outside_the_graph_without_recompiles(tmp_path):
    run_ranks(_ep2_alltoall, 2, tmp_path, timeout_s=300)


@pytest.mark.slow
def test_compile_traces_recompute_regions_in_one_process():
    """Dynamo traces a recompute region (non-reentrant checkpoint with the selective policy) into the
    compiled block: a dense tiny model with every decoder layer recomputed (full) compiles to a graph
    without graph breaks, matches eager (loss, gradients) and does not recompile.  (A graph break inside
    a region, such as the fp32 grouped-GEMM seam of an MoE layer on the CPU, makes dynamo run that whole
    region eagerly: the counters show it.)"""
    from moevlm.parallel.recompute import apply_recompute

    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend, cfg.moe.num_experts = (
        "sdpa",
        0,
    )  # dense: no fp32 grouped-GEMM seam (a graph break)
    cfg.vision.depth, cfg.vision.deepstack_visual_indexes = 1, ()

    def build(cfg):
        model = Qwen3VLMoe(cfg)
        apply_recompute(model, "full")
        return model

    eager = Qwen3VLMoe(cfg)
    compiled_model = build(cfg)
    compiled_model.load_state_dict(eager.state_dict())
    compiled, c = _two_steps_beside_eager(eager, compiled_model, cfg, bf16=False, rtol=1e-5)
    assert c["compiled_graphs"] >= 1 and c["graph_breaks"] == 0 and c["recompiles"] == 0, c
    w = "text.layers.0.mlp.gate_proj.weight"
    torch.testing.assert_close(
        compiled.get_parameter(w).grad, eager.get_parameter(w).grad, rtol=1e-4, atol=1e-6
    )


def test_bf16_moe_layer_compiles_without_graph_breaks():
    """In bf16 the torch grouped GEMM (`torch._grouped_mm`, whose fake kernel takes bf16 only) is traced
    into the decoder layer's graph: an MoE model compiles with no graph break and no recompile, and the
    loss stays within bf16 tolerance of eager.  (In fp32 that seam runs eagerly: one break per MoE layer.)"""
    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"
    cfg.vision.depth, cfg.vision.deepstack_visual_indexes = 1, ()

    def build(cfg):
        torch.manual_seed(0)
        return Qwen3VLMoe(cfg).to(torch.bfloat16)

    eager, compiled_model = build(cfg), build(cfg)
    assert any(layer.is_moe for layer in compiled_model.text.layers)
    _, c = _two_steps_beside_eager(eager, compiled_model, cfg, bf16=True, rtol=2e-2)
    assert c["compiled_graphs"] >= 1 and c["graph_breaks"] == 0 and c["recompiles"] == 0, c


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-dense", "bf16-moe"])
def test_lora_adapters_compile_into_the_blocks(bf16):
    """LoRA adapters (model.lora_rank) under train.compile: traced into each block's graph with no graph
    break and no recompile, the frozen base without gradients.  fp32 dense (adapters on attention and
    MLP): loss and the adapters' gradients equal eager's; bf16 MoE (adapters on attention and the
    experts' grouped GEMM): loss within bf16 tolerance of eager, adapters trained."""
    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"
    cfg.vision.depth, cfg.vision.deepstack_visual_indexes = 1, ()
    if not bf16:
        cfg.moe.num_experts = 0  # fp32 MoE: the grouped GEMM seam is a graph break
    cfg.lora.rank = 8
    cfg.lora.modules = ("attn", "experts") if bf16 else ("attn", "mlp")

    def build(cfg):
        torch.manual_seed(0)
        model = Qwen3VLMoe(cfg.validate())
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("B"):  # B at zero gives A no gradient: draw it
                    p.normal_(0.0, 0.02)
        return model.to(torch.bfloat16) if bf16 else model

    rtol = 2e-2 if bf16 else 1e-5
    eager = build(cfg)
    compiled, c = _two_steps_beside_eager(eager, build(cfg), cfg, bf16=bf16, rtol=rtol)
    assert c["compiled_graphs"] >= 1 and c["graph_breaks"] == 0 and c["recompiles"] == 0, c
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.grad is not None}
    assert grads and all(".lora." in n for n in grads), sorted(grads)
    if bf16:
        assert any(".experts.lora." in n and g.abs().sum() > 0 for n, g in grads.items())
    else:
        for n, g in grads.items():
            torch.testing.assert_close(g, eager.get_parameter(n).grad, rtol=1e-4, atol=1e-6)
