"""The closed-form parameter counts (moevlm.model.params) equal the built model's, part by part."""

import dataclasses

import pytest
import torch

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.params import layer_parameters, num_parameters, parameter_counts


def _tiny(**text):
    cfg = VLMConfig.preset("tiny")
    cfg.text = dataclasses.replace(cfg.text, **text)
    return cfg


def _variants():
    tied = _tiny(num_layers=5, attention_bias=True)
    tied.tie_word_embeddings = True
    tied.moe = dataclasses.replace(tied.moe, mlp_only_layers=(1, 3), num_experts=4)
    sparse = _tiny(num_layers=4)
    sparse.moe = dataclasses.replace(sparse.moe, decoder_sparse_step=2, num_experts=16)
    sparse.vision = dataclasses.replace(sparse.vision, depth=3, deepstack_visual_indexes=(0, 2))
    dense = _tiny(num_layers=2)
    dense.moe = dataclasses.replace(dense.moe, num_experts=0)
    return {
        "tiny": VLMConfig.preset("tiny"),
        "tied_bias_dense_layers": tied,
        "sparse_step_deepstack": sparse,
        "no_experts": dense,
        "qwen3_vl_30b_a3b": VLMConfig.preset("qwen3_vl_30b_a3b"),
    }


@pytest.mark.parametrize("name", list(_variants()))
def test_counts_equal_the_meta_model(name):
    cfg = _variants()[name]
    with torch.device("meta"):
        model = Qwen3VLMoe(cfg)
    built = {
        "vision": model.vision,
        "embed_tokens": model.text.embed_tokens,
        "layers": model.text.layers,
        "norm": model.text.norm,
    }
    counts = parameter_counts(cfg)
    for part, module in built.items():
        assert counts[part] == sum(p.numel() for p in module.parameters()), part
    # a tied head counted once
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.text.layers):
        parts = layer_parameters(cfg, i)
        assert sum(parts.values()) == sum(p.numel() for p in layer.parameters()), i
        assert parts["experts"] == sum(
            p.numel() for n, p in layer.named_parameters() if ".experts." in n
        )
        assert parts["k_v"] == sum(
            p.numel()
            for n, p in layer.named_parameters()
            if n.split(".")[1] in ("k_proj", "v_proj")
        )
