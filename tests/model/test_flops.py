"""The analytic FLOP count against torch's FlopCounterMode on the tiny model,
vision and decoder separately, forward and forward+backward.  MFU needs it within
5%; the count is exact (same convention), so the tests hold it to 1e-9."""

import pytest
import torch
from hf_ref import sample
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from moevlm.model import Qwen3VLMoe, VLMConfig, count_flops
from moevlm.model.flops import doc_lens_of


def _measure(fn) -> int:
    # The math SDPA path decomposes into matmuls the counter sees; the fused CPU
    # kernel is not registered with FlopCounterMode and would count as zero.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def model():
    # Per-document SDPA and the per-expert loop: the ops FlopCounterMode can see
    # (it does not count torch._grouped_mm), doing exactly the useful work.
    cfg = VLMConfig.preset("tiny").replace(attn_backend="sdpa_per_doc")
    cfg.moe.grouped_gemm = "loop"
    return Qwen3VLMoe(cfg)


def test_vision_flops_match_flop_counter(model):
    cfg = model.config
    _, px, grid = sample(cfg, [(1, 4, 6), (1, 8, 8), (1, 6, 2)])
    px.requires_grad_(False)
    fwd = _measure(lambda: model.vision(px, grid))

    def step():
        merged, deepstack = model.vision(px, grid)
        sum(t.sum() for t in [merged, *deepstack]).backward()

    train = _measure(step)
    ours_fwd = count_flops(cfg, [], grid, training=False).vision
    ours_train = count_flops(cfg, [], grid).vision
    assert abs(ours_fwd / fwd - 1) < 1e-9, (ours_fwd, fwd)
    assert abs(ours_train / train - 1) < 1e-9, (ours_train, train)
    assert count_flops(cfg, [], grid, freeze_vision=True).vision == ours_fwd


def test_decoder_flops_match_flop_counter_with_packed_documents(model):
    cfg = model.config
    ids = torch.randint(0, 1000, (2, 48))
    cu = torch.tensor([0, 20, 48, 60, 96], dtype=torch.int32)
    lens = doc_lens_of(2, 48, cu)
    assert lens == [20, 28, 12, 36]
    fwd = _measure(lambda: model(ids, cu_seqlens=cu))
    train = _measure(lambda: model(ids, cu_seqlens=cu, labels=ids).loss.backward())
    ours = count_flops(cfg, lens, training=False)
    assert ours.vision == 0
    assert abs(ours.decoder / fwd - 1) < 1e-9, (ours.decoder, fwd)
    assert abs(count_flops(cfg, lens).decoder / train - 1) < 1e-9


def test_whole_model_with_images(model):
    cfg = model.config
    ids, px, grid = sample(cfg, [(1, 4, 6), (1, 8, 4)])
    fwd = _measure(lambda: model(ids, px, grid))
    train = _measure(lambda: model(ids, px, grid, labels=ids).loss.backward())
    ours_fwd = count_flops(cfg, [ids.shape[1]], grid, training=False)
    ours_train = count_flops(cfg, [ids.shape[1]], grid)
    assert ours_fwd.vision > 0 and ours_fwd.decoder > 0
    assert abs(ours_fwd.total / fwd - 1) < 1e-9, (ours_fwd.total, fwd)
    assert abs(ours_train.total / train - 1) < 1e-9, (ours_train.total, train)
