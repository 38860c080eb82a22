"""Our model against transformers' Qwen3VLMoeForConditionalGeneration, loaded from
the reference's own saved checkpoint: logits, loss, aux loss and every gradient."""

import dataclasses

import pytest
import torch
from hf_ref import hf_forward, hf_grads_as_ours, pair, rel_err, sample

from moevlm.model import Qwen3VLMoe, VLMConfig

TOL = 1e-5


def _tiny(**moe_changes):
    cfg = VLMConfig.preset("tiny").replace(attn_backend="sdpa")
    cfg.moe = dataclasses.replace(cfg.moe, **moe_changes)
    return cfg


def _wide_gqa():
    """GQA ratio 4, two deepstack layers, top-3, every other layer sparse."""
    cfg = _tiny(top_k=3, decoder_sparse_step=2)
    cfg.text = dataclasses.replace(
        cfg.text, num_heads=8, num_kv_heads=2, head_dim=8, mrope_section=(2, 1, 1)
    )
    cfg.vision = dataclasses.replace(cfg.vision, deepstack_visual_indexes=(0, 1))
    return cfg


def _no_deepstack_top1():
    cfg = _tiny(top_k=1, mlp_only_layers=(1,))
    cfg.vision = dataclasses.replace(cfg.vision, deepstack_visual_indexes=())
    return cfg


CONFIGS = {
    "tiny": _tiny,
    "gqa4_deepstack2_top3_step2": _wide_gqa,
    "no_deepstack_top1_dense1": _no_deepstack_top1,
}
INPUTS = {"text": [], "one_image": [(1, 4, 6)], "two_images": [(1, 4, 6), (1, 8, 4)]}


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_forward_loss_aux_and_gradients_match_reference(config, inputs, tmp_path):
    cfg = CONFIGS[config]()
    ref, ours = pair(cfg, tmp_path)
    ids, pixels, grid = sample(cfg, INPUTS[inputs], batch=2 if inputs == "text" else 1)
    labels = ids.clone()
    labels[:, :3] = -100  # a masked prompt
    r = hf_forward(ref, ids, pixels, grid, labels)
    o = ours(ids, pixels, grid, labels=labels)

    assert rel_err(o.logits.detach(), r.logits.detach()) < TOL
    assert rel_err(o.aux_loss.detach(), r.aux_loss.detach()) < TOL
    assert rel_err(o.loss.detach(), r.loss.detach()) < TOL

    r.loss.backward()
    o.loss.backward()
    ref_grads = hf_grads_as_ours(ref, cfg)
    our_grads = {
        n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ours.named_parameters()
    }
    assert set(our_grads) == set(ref_grads)
    # With top-1 the renormalised weight is p/p == 1: the LM loss gives the router an
    # exact-zero gradient that both sides compute as rounding noise of the same size
    # as the aux-loss gradient.  That case is compared in float64 below.
    skip = "mlp.router" if cfg.moe.top_k == 1 else "<none>"
    worst = max((rel_err(our_grads[n], ref_grads[n]), n) for n in ref_grads if skip not in n)
    assert worst[0] < TOL, worst
    if pixels is not None:  # the vision path really was compared
        assert all(
            g.abs().sum() > 0 for n, g in our_grads.items() if "pos_embed" in n or "merger" in n
        )


def test_top1_router_gradient_in_float64(tmp_path):
    """Top-1: the LM loss reaches the router only through p/p == 1, an exact zero.
    In float64 ours is zero to rounding; the reference upcasts logits to fp32 for
    its loss, so its zero is fp32 noise (~1e-9).  The router's true gradient is
    the aux term, compared here against the reference's aux-only gradient."""
    cfg = _no_deepstack_top1()
    cfg.moe.grouped_gemm = "loop"  # torch._grouped_mm has no float64
    ref, ours = pair(cfg, tmp_path)
    ref.double(), ours.double()
    ids, _, _ = sample(cfg, [], batch=2)
    routers = [n for n, _ in ours.named_parameters() if "router" in n]

    ours(ids, labels=ids).lm_loss.backward()
    assert all(float(ours.get_parameter(n).grad.abs().max()) < 1e-14 for n in routers)

    ours.zero_grad()
    ours(ids, labels=ids).loss.backward()
    hf_forward(ref, ids, None, None).aux_loss.backward()
    ref_grads = hf_grads_as_ours(ref, cfg)
    coef = cfg.moe.router_aux_loss_coef
    for n in routers:
        assert rel_err(ours.get_parameter(n).grad, coef * ref_grads[n]) < 1e-6, n


def test_packed_documents_equal_separate_reference_runs(tmp_path):
    """Two documents (one with an image) packed in one row with cu_seqlens give the
    logits the reference gives on each document alone, and the loss never
    predicts across the document boundary."""
    cfg = _tiny()
    ref, ours = pair(cfg, tmp_path)
    ids_a, px_a, grid_a = sample(cfg, [(1, 4, 6)], seed=1)
    ids_b, _, _ = sample(cfg, [], text_len=11, seed=2)
    ids = torch.cat([ids_a, ids_b], dim=1)
    cu = torch.tensor([0, ids_a.shape[1], ids.shape[1]], dtype=torch.int32)
    for backend in ("sdpa", "sdpa_per_doc"):
        ours.set_attn_backend(backend)
        o = ours(ids, px_a, grid_a, cu_seqlens=cu, labels=ids)
        r_a = hf_forward(ref, ids_a, px_a, grid_a).logits
        r_b = hf_forward(ref, ids_b, None, None).logits
        assert rel_err(o.logits.detach(), torch.cat([r_a, r_b], dim=1).detach()) < TOL

    logits = torch.cat([r_a, r_b], dim=1)[0]
    targets = ids[0, 1:].clone()
    targets[ids_a.shape[1] - 1] = -100  # last token of document A predicts nothing
    expected = torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=-100)
    assert rel_err(o.lm_loss.detach(), expected.detach()) < TOL
    assert int(o.num_loss_tokens) == ids.shape[1] - 2


def test_export_loads_in_transformers_with_identical_logits(tmp_path):
    cfg = _tiny()
    ref, ours = pair(cfg, tmp_path)
    ids, px, grid = sample(cfg, [(1, 4, 6), (1, 8, 4)])
    expected = ours(ids, px, grid).logits.detach()
    for layout in ("hub", "hf"):
        ours.save_pretrained(tmp_path / layout, expert_layout=layout)
        back = type(ref).from_pretrained(tmp_path / layout, attn_implementation="sdpa").eval()
        back.set_experts_implementation("eager")
        assert torch.equal(
            hf_forward(back, ids, px, grid).logits.detach(),
            hf_forward(ref, ids, px, grid).logits.detach(),
        )
        again = Qwen3VLMoe.from_pretrained(tmp_path / layout, attn_backend="sdpa")
        assert torch.equal(again(ids, px, grid).logits.detach(), expected)


def test_hub_layout_and_sharded_index_load(tmp_path):
    """A hub-layout checkpoint (E, D, 2F)/(E, F, D) split over several shards with an
    index loads to the same model as the transformers-layout single file."""
    cfg = _tiny()
    ref, ours = pair(cfg, tmp_path)
    ours.save_pretrained(tmp_path / "sharded", expert_layout="hub", max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert (
        "model.safetensors.index.json" in files
        and sum(f.endswith(".safetensors") for f in files) > 2
    )
    loaded = Qwen3VLMoe.from_pretrained(tmp_path / "sharded", attn_backend="sdpa")
    for (n, a), (_, b) in zip(loaded.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), n
    hub = Qwen3VLMoe.from_pretrained(tmp_path / "sharded")
    gate_up = hub.text.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape == (
        cfg.moe.num_experts,
        cfg.text.hidden_size,
        2 * cfg.moe.moe_intermediate_size,
    )
