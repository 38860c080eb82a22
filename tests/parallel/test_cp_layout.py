"""Context parallel's index logic, without processes, on hand-worked cases: the zigzag split, its
inverse, the attention work it balances, and the image shares of the vision tower."""

import pytest
import torch

from moevlm.model.image_shares import balance_images, frame_grids
from moevlm.parallel.cp_layout import (
    attention_work,
    check_divisible,
    contiguous_positions,
    doc_zigzag_positions,
    inverse_order,
    split_rows,
    take_rows,
    take_seq,
    zigzag_positions,
)


def test_zigzag_by_hand():
    # S = 8, cp = 2: chunks of 2 -> rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # S = 16, cp = 4: chunks of 2; rank r keeps chunk r and 7 - r
    assert [zigzag_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert contiguous_positions(8, 2, 1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("S,cp", [(8, 2), (24, 4), (48, 3)])
def test_every_position_once_and_the_inverse(S, cp):
    every = torch.cat([zigzag_positions(S, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(S))
    x = torch.arange(S) * 10
    gathered = torch.cat([take_seq(x[None], zigzag_positions(S, cp, r))[0] for r in range(cp)])
    # rank-order concatenation back to row order
    assert torch.equal(gathered[inverse_order(S, cp)], x)


def test_uneven_rows_are_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match="cannot be cut into 2\\*cp = 4 equal chunks: set data.seq_len to a multiple of 4",
    ):
        check_divisible(10, 2)
    with pytest.raises(ValueError):
        zigzag_positions(12, 4, 0)


def test_attention_work_by_hand():
    # one causal document of 8 tokens: query i sees i + 1 keys -> 1..8, total 36
    doc = torch.zeros(1, 8, dtype=torch.long)
    zig = [zigzag_positions(8, 2, r) for r in range(2)]
    naive = [contiguous_positions(8, 2, r) for r in range(2)]
    # balanced exactly
    assert attention_work(doc, zig) == [1 + 2 + 7 + 8, 3 + 4 + 5 + 6] == [18, 18]
    assert attention_work(doc, naive) == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8] == [10, 26]
    # two documents [0, 4) and [4, 8): each query sees its document's earlier keys
    doc2 = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert attention_work(doc2, zig) == [1 + 2 + 3 + 4, 3 + 4 + 1 + 2] == [10, 10]
    assert attention_work(doc2, zig, causal=False) == [16, 16]


def test_images_balanced_largest_first():
    assert balance_images([64, 16, 16, 32], 2) == [[0], [1, 2, 3]]  # 64 vs 16 + 16 + 32
    assert balance_images([4, 4, 4], 2) == [[0, 2], [1]]
    assert balance_images([], 2) == [[], []]
    assert balance_images([8], 3) == [
        [0],
        [],
        [],
    ]  # a rank without an image still runs its tower (padding)


def test_video_frames_are_shared_as_images():
    """A video (t, h, w) is t frames (1, h, w) to the balance: one 4-frame video and an image spread
    over 2 ranks instead of landing whole on one."""
    grids = frame_grids([(1, 4, 4), (4, 4, 8), (1, 2, 2)])
    assert grids == [(1, 4, 4), *[(1, 4, 8)] * 4, (1, 2, 2)]
    assert balance_images([t * h * w for t, h, w in grids], 2) == [[0, 1, 3], [2, 4, 5]]


def test_per_document_split_by_hand():
    # one document of 8 = the row-level zigzag
    assert doc_zigzag_positions([0, 8], 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # documents [0, 3) and [3, 8), cp 2 (4 chunks a document): [0, 3) has no whole chunk size (3 // 4 = 0)
    # and 3 extra tokens: rank 0 (fewest, first) takes chunk 0 = {0}, rank 1 chunk 1 = {1}, rank 0 again
    # its chunk 3 = {2}; [3, 8): 5 = 4 x 1 + 1 extra, to rank 1 (fewest): chunks {3}, {4, 5}, {6}, {7}
    assert doc_zigzag_positions([0, 3, 8], 2) == [[0, 2, 3, 7], [1, 4, 5, 6]]
    # rows of a micro-batch split on their own boundaries (cu_seqlens over the flattened B*S tokens)
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    assert split_rows(2, 8, cu, 2, 1).tolist() == [[1, 4, 5, 6], [10 - 8, 11 - 8, 12 - 8, 13 - 8]]
    assert split_rows(2, 8, None, 2, 0).tolist() == [[0, 1, 6, 7]] * 2


def test_per_document_split_keeps_every_token_once_balanced():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        cp = int(torch.randint(2, 6, (), generator=g))
        S = 2 * cp * int(torch.randint(1, 30, (), generator=g))
        cuts = torch.randperm(S - 1, generator=g)[: int(torch.randint(0, 10, (), generator=g))] + 1
        bounds = [0, *sorted(cuts.tolist()), S]
        out = doc_zigzag_positions(bounds, cp)
        assert sorted(sum(out, [])) == list(range(S)) and all(len(o) == S // cp for o in out)
        # every rank holds 2 chunks of each document: within 2 tokens
        for a, b in zip(bounds, bounds[1:]):
            n = [sum(a <= p < b for p in o) for o in out]
            assert max(n) - min(n) <= 2, (bounds, cp, n)


def test_take_rows_per_row_and_zero_gradient_elsewhere():
    x = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3).requires_grad_()
    idx = torch.tensor([[0, 5], [2, 3]])
    y = take_rows(x, idx)
    assert torch.equal(y, torch.stack([x[0, [0, 5]], x[1, [2, 3]]]))
    y.sum().backward()
    assert x.grad.sum(-1).tolist() == [[3, 0, 0, 0, 0, 3], [0, 0, 3, 3, 0, 0]]
    # (3, B, S) M-RoPE ids: the sequence is dim 2
    pos = torch.arange(2 * 6).view(1, 2, 6).expand(3, 2, 6)
    assert take_rows(pos, idx, dim=2)[:, 1].tolist() == [[8, 9]] * 3
