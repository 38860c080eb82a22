"""CUDA-graph scopes on the CPU: the regions' boundaries (the exact function a capture would graph,
run eagerly, equals the plain layer), nothing is captured off CUDA, and every combination that
cannot be captured safely is refused at validation with its reason.  Replay itself:
tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.attention import doc_mask
from moevlm.parallel.cuda_graphs import apply_cuda_graphs, cuda_graphs

SCOPES = [
    ["attn"],
    ["moe_router"],
    ["moe_preprocess"],
    ["attn", "moe_router", "moe_preprocess"],
    ["full_layer"],
]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = VLMConfig.preset("tiny")
    cfg.attn_backend = "sdpa"  # the one backend a graph captures (auto is sdpa_per_doc on the CPU)
    return Qwen3VLMoe(cfg)


def _loss_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, **kw)
    loss = out.lm_loss + 0.01 * out.aux_loss
    loss.backward()
    return (
        loss.detach(),
        out.expert_counts,
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("scope", SCOPES, ids=",".join)
def test_region_tensor_form_equals_the_plain_layer(tiny, scope):
    """What a capture graphs (tensors in, tensors out, stats deferred) computes exactly what the layer does:
    loss, expert counts and every gradient, with documents (a bool mask) and padding (token mask), and
    with one document per row (SDPA's own causal mask)."""
    wrapped = copy.deepcopy(tiny)
    graphs = apply_cuda_graphs(wrapped, scope)
    graphs.set_tensor_form(True)
    built = []  # every region really runs through its tensor form (the seams are used)
    for r in graphs.regions:
        r.region.build = (lambda build, r: lambda fn, key: built.append(r) or build(fn, key))(
            r.region.build, r
        )
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 10, 24, 30, 44, 48], dtype=torch.int32)
    token_mask = torch.arange(24)[None].expand(2, 24) < torch.tensor([[24], [20]])
    for kw in ({"cu_seqlens": cu, "token_mask": token_mask}, {}):
        ref_loss, ref_counts, ref_grads = _loss_and_grads(tiny, ids, **kw)
        loss, counts, grads = _loss_and_grads(wrapped, ids, **kw)
        assert torch.equal(loss, ref_loss) and torch.equal(counts, ref_counts)
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [
            n for n in grads if not torch.equal(grads[n], ref_grads[n])
        ]
    assert {id(r) for r in built} == {id(r) for r in graphs.regions}
    assert set(graphs.captures().values()) == {0}  # nothing is captured off CUDA


def test_regions_wrap_every_layer_and_stay_eager_on_cpu(tiny):
    model = copy.deepcopy(tiny)
    graphs = apply_cuda_graphs(model, ["attn", "moe_router", "moe_preprocess"])
    n_layers, n_moe = len(model.text.layers), sum(layer.is_moe for layer in model.text.layers)
    kinds = [r.region.kind for r in graphs.regions]
    assert (
        kinds.count("attn") == n_layers
        and kinds.count("moe_router") == kinds.count("moe_preprocess") == n_moe
    )
    assert cuda_graphs(model) is graphs and apply_cuda_graphs(model, []) is None
    # no new params
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in tiny.named_parameters()}
    ids = torch.randint(0, 1000, (1, 16))
    assert torch.equal(model(ids, labels=ids).lm_loss, tiny(ids, labels=ids).lm_loss)
    assert set(graphs.captures().values()) == {0}


@pytest.mark.parametrize("name", ["local", "alltoall"])
def test_dispatch_starts_from_preprocess(name):
    """The seam a `moe_preprocess` graph replaces: `dispatch` takes its plan from `self.preprocess`."""
    from moevlm.dispatch import build_dispatcher

    d = build_dispatcher(name, num_experts=4, top_k=2)
    x, idx = torch.randn(5, 3), torch.randint(0, 4, (5, 2))
    w = torch.rand(5, 2)
    rows, counts, _ = d.dispatch(x, idx, w)
    plan = d.preprocess(idx, w)
    d.preprocess = lambda *a: (
        plan[0].flip(0),
        plan[1],
        plan[2],
    )  # a different plan must show in the rows
    assert torch.equal(d.dispatch(x, idx, w)[0], rows.flip(0)) and torch.equal(counts, plan[2])


def test_region_refuses_another_attention_backend(tiny):
    model = copy.deepcopy(tiny)
    apply_cuda_graphs(model, ["attn"])
    layer = model.text.layers[0]
    mask = doc_mask(1, 8, None, causal=True, backend="sdpa_per_doc")
    with pytest.raises(
        RuntimeError, match="captures the sdpa attention only .* set model.attn_backend=sdpa"
    ):
        layer.attention_part(
            torch.zeros(1, 8, model.config.text.hidden_size), (torch.zeros(1, 8, 1),) * 2, mask
        )
    with pytest.raises(ValueError, match=r"unknown region\(s\) \['mlp'\]; choose among"):
        apply_cuda_graphs(copy.deepcopy(tiny), ["mlp"])


# ------------------------------------------------------------------ validation
def _errors(overrides, world=1, environment=False, extra=None) -> str:
    job = compose_job(overrides)
    # options of other parts of the trainer (train.compile, model.recompute), untyped here
    if extra:
        job = OmegaConf.create(OmegaConf.to_container(job, resolve=True))
        for key, value in extra.items():
            OmegaConf.update(job, key, value)
    with pytest.raises(ConfigError) as err:
        validate(job, world_size=world, environment=environment)
    return str(err.value)


OK = ["model.cuda_graph_scope=[attn,moe_router,moe_preprocess]", "model.attn_backend=sdpa"]


def test_cpu_is_refused_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    msg = _errors(OK, environment=True)
    assert (
        "model.cuda_graph_scope=[attn,moe_router,moe_preprocess] captures CUDA graphs, which need a CUDA "
        "device; this job runs on the CPU: use model.cuda_graph_scope=[]"
    ) in msg
    assert len(msg.splitlines()) == 1  # the scope itself is fine
    validate(compose_job(OK), environment=False)  # a GPU recipe checked on a laptop passes


REFUSALS = {
    "unknown": (
        ["model.cuda_graph_scope=[attn,mlp]"],
        1,
        None,
        "model.cuda_graph_scope has unknown region(s) ['mlp']; choose among ['attn', 'moe_router', "
        "'moe_preprocess', 'full_layer']",
    ),
    "full_layer_not_alone": (
        ["model.cuda_graph_scope=[full_layer,attn]", "model.attn_backend=sdpa"],
        1,
        None,
        "full_layer already holds attn, moe_router and moe_preprocess; list it alone",
    ),
    "fsdp": (
        OK + ["parallel.dp_mode=fsdp"],
        2,
        None,
        "cannot run under FSDP (parallel.dp_mode=fsdp over several processes): FSDP2 frees the unsharded",
    ),
    "pipeline": (
        OK + ["parallel.dp_mode=ddp", "parallel.pp=2"],
        2,
        None,
        "cannot run with pipeline parallel (parallel.pp>1)",
    ),
    "tp": (
        OK + ["parallel.dp_mode=ddp", "parallel.tp=2"],
        2,
        None,
        "cannot capture the tensor/context-parallel collectives",
    ),
    "backend": (
        ["model.cuda_graph_scope=[attn]", "model.attn_backend=flex"],
        1,
        None,
        "captures attention with the sdpa backend only",
    ),
    "auto_backend": (
        ["model.cuda_graph_scope=[full_layer]"],
        1,
        None,
        "model.attn_backend=auto: set model.attn_backend=sdpa",
    ),
    "full_layer_alltoall": (
        [
            "model.cuda_graph_scope=[full_layer]",
            "model.attn_backend=sdpa",
            "parallel.dp_mode=ddp",
            "parallel.ep=2",
        ],
        2,
        None,
        "moves a data-dependent number of tokens after a host sync",
    ),
    "loop": (
        [
            "model.cuda_graph_scope=[full_layer]",
            "model.attn_backend=sdpa",
            "model.grouped_gemm=loop",
        ],
        1,
        None,
        "full_layer cannot capture model.grouped_gemm=loop",
    ),
    "permute": (
        OK + ["model.permute=triton"],
        1,
        None,
        "moe_preprocess captures the torch permutation plan",
    ),
    "dense": (OK + ["model.num_experts=0"], 1, None, "this model has no MoE layers"),
    "compile": (
        OK,
        1,
        {"train.compile": True},
        "and train.compile=true both capture the same code",
    ),
    "recompute": (OK, 1, {"model.recompute": "selective"}, "cannot run with model.recompute"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_name_the_reason(case):
    overrides, world, extra, words = REFUSALS[case]
    msg = _errors(overrides, world, extra=extra)
    assert words in msg, msg


def test_the_allowed_layouts_pass():
    validate(
        compose_job(OK + ["parallel.dp_mode=ddp", "parallel.ep=2"]), world_size=2, environment=False
    )
    validate(
        compose_job(["model.cuda_graph_scope=[full_layer]", "model.attn_backend=sdpa"]),
        environment=False,
    )
