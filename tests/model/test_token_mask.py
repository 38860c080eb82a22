"""`token_mask` keeps a packed row's padding out of the router statistics and changes nothing else."""

import pytest
import torch

from moevlm.model import Qwen3VLMoe, VLMConfig


def test_padding_is_left_out_of_router_stats():
    torch.manual_seed(0)
    model = Qwen3VLMoe(VLMConfig.preset("tiny"))
    ids = torch.randint(0, 1000, (1, 40))
    cu = torch.tensor([0, 25, 40, 40], dtype=torch.int32)  # one document, then a padding document
    mask = torch.arange(40)[None] < 25
    alone = model(ids[:, :25], labels=ids[:, :25])
    padded = model(ids, cu_seqlens=cu, labels=ids.masked_fill(~mask, -100), token_mask=mask)
    unmasked = model(ids, cu_seqlens=cu, labels=ids.masked_fill(~mask, -100))
    assert torch.allclose(padded.aux_loss, alone.aux_loss, atol=1e-6)
    assert torch.equal(padded.expert_counts, alone.expert_counts)
    # padding would count otherwise
    assert not torch.equal(unmasked.expert_counts, alone.expert_counts)
    assert torch.allclose(padded.lm_loss, unmasked.lm_loss) and torch.allclose(
        padded.logits, unmasked.logits
    )


def test_bad_token_mask_is_named():
    model = Qwen3VLMoe(VLMConfig.preset("tiny"))
    ids = torch.randint(0, 1000, (1, 8))
    with pytest.raises(ValueError, match="token_mask must be a bool tensor"):
        model(ids, token_mask=torch.ones(1, 8))
