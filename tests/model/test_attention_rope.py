"""Attention backends agree and respect documents; rotary tables and 3-D position
ids equal the reference's own helpers; meta-device construction."""

import pytest
import torch
from hf_ref import pair, sample, transformers

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.attention import attention, doc_mask, document_ids
from moevlm.model.rope import mrope_position_ids, pos_embed_taps, vision_patch_rows_cols


def _qkv(B=2, S=24, H=4, K=2, hd=8):
    return torch.randn(B, S, H, hd), torch.randn(B, S, K, hd), torch.randn(B, S, K, hd)


def _attn(q, k, v, causal, cu_seqlens=None, backend="sdpa"):
    mask = doc_mask(q.shape[0], q.shape[1], cu_seqlens, causal=causal, backend=backend)
    return attention(q, k, v, mask)


@pytest.mark.parametrize("causal", [True, False])
def test_backends_agree_on_packed_documents(causal):
    q, k, v = _qkv()
    cu = torch.tensor([0, 5, 24, 30, 31, 48], dtype=torch.int32)  # one doc crosses the row end
    ref = _attn(q, k, v, causal, cu, "sdpa_per_doc")
    for backend in ("sdpa", "flex"):
        out = _attn(q, k, v, causal, cu, backend)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_documents_do_not_see_each_other():
    q, k, v = _qkv(B=1, S=20)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    out = _attn(q, k, v, True, cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, 8:] += 1.0
    v2[:, 8:] -= 1.0
    out2 = _attn(q, k2, v2, True, cu)
    assert torch.equal(out[:, :8], out2[:, :8]) and not torch.allclose(out[:, 8:], out2[:, 8:])
    assert document_ids(1, 20, cu, "cpu").tolist() == [[0] * 8 + [1] * 12]


def test_gradients_through_document_mask_match_per_document():
    q, k, v = (t.requires_grad_() for t in _qkv())
    cu = torch.tensor([0, 7, 24, 40, 48], dtype=torch.int32)
    grads = []
    for backend in ("sdpa", "sdpa_per_doc"):
        out = _attn(q, k, v, True, cu, backend)
        grads.append(
            torch.autograd.grad(
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v)
            )
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flash_backend_without_the_package_says_so():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="flash-attn"):
        _attn(q, k, v, True, backend="flash")
    # no flash-attn, no CUDA
    assert doc_mask(2, 24, None, causal=True, backend="auto").backend == "sdpa_per_doc"
    assert _attn(q, k, v, True, backend="auto").shape == q.shape


def test_flex_model_forward_equals_sdpa(tmp_path):
    cfg = VLMConfig.preset("tiny").replace(attn_backend="sdpa")
    model = Qwen3VLMoe(cfg).eval()
    flex = Qwen3VLMoe(cfg.replace(attn_backend="flex")).eval()
    flex.load_state_dict(model.state_dict())
    ids, px, grid = sample(cfg, [(1, 4, 6)])
    with torch.no_grad():
        torch.testing.assert_close(
            flex(ids, px, grid).logits, model(ids, px, grid).logits, atol=1e-5, rtol=1e-5
        )


def test_position_ids_equal_reference_get_rope_index(tmp_path):
    cfg = VLMConfig.preset("tiny")
    ref, _ = pair(cfg, tmp_path)
    ids, _, grid = sample(cfg, [(1, 4, 6), (1, 8, 4), (1, 2, 10)], batch=2)
    expected, _ = ref.model.get_rope_index(
        ids, (ids == cfg.image_token_id).int(), image_grid_thw=grid
    )
    assert torch.equal(mrope_position_ids(ids, grid, cfg.image_token_id, 2), expected)


def test_position_ids_restart_per_document_and_split_adjacent_images():
    cfg = VLMConfig.preset("tiny")
    img = cfg.image_token_id
    # doc 0: 2 text, an image (1,2,4) = 2 tokens, an adjacent image (1,4,2) = 2 tokens, 1 text; doc 1: 3 text
    ids = torch.tensor([[5, 6, img, img, img, img, 7, 8, 9, 10]])
    grid = torch.tensor([[1, 2, 4], [1, 4, 2]])
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    pos = mrope_position_ids(ids, grid, img, 2, cu)[:, 0].T.tolist()
    assert pos == [
        [0, 0, 0],
        [1, 1, 1],
        [2, 2, 2],
        [2, 2, 3],
        [4, 4, 4],
        [4, 5, 4],
        [6, 6, 6],
        [0, 0, 0],
        [1, 1, 1],
        [2, 2, 2],
    ]


def test_vision_position_tables_equal_reference_helpers():
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    grid = torch.tensor([[1, 4, 6], [1, 8, 8], [2, 2, 4], [1, 16, 2]])
    assert torch.equal(vision_patch_rows_cols(grid, 2), get_vision_position_ids(grid, 2))
    idx, wts = pos_embed_taps(vision_patch_rows_cols(grid, 2), grid, 8)
    ref_idx, ref_wts = get_vision_interpolation_indices_and_weights(grid, 8, "bilinear", True, 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(wts, ref_wts)


def test_meta_construction_then_init_is_a_working_model():
    cfg = VLMConfig.preset("tiny")
    with torch.device("meta"):
        model = Qwen3VLMoe(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    eager = Qwen3VLMoe(cfg)
    torch.manual_seed(0)
    eager.init_weights()  # init_weights alone decides the values, wherever the model was built
    for (n, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), n
    norms = [p for n, p in model.named_parameters() if "norm" in n and n.endswith("weight")]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    std = model.text.layers[0].mlp.experts.gate_up_proj.detach().std()
    assert abs(float(std) - cfg.text.initializer_range) < 2e-3
    ids, _, _ = sample(cfg, [])
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_tied_embeddings_share_storage_and_export(tmp_path):
    cfg = VLMConfig.preset("tiny").replace(tie_word_embeddings=True, attn_backend="sdpa")
    model = Qwen3VLMoe(cfg)
    assert model.lm_head.weight is model.text.embed_tokens.weight
    model.save_pretrained(tmp_path)
    back = Qwen3VLMoe.from_pretrained(tmp_path, attn_backend="sdpa")
    assert back.lm_head.weight is back.text.embed_tokens.weight
    ids, px, grid = sample(cfg, [(1, 4, 6)])
    assert torch.equal(back(ids, px, grid).logits, model(ids, px, grid).logits)
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)
    # some tied checkpoints also store the head: it is the same tensor, not an error
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    sd["lm_head.weight"] = sd["model.language_model.embed_tokens.weight"].clone()
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(Qwen3VLMoe.from_pretrained(tmp_path).lm_head.weight, model.lm_head.weight)
