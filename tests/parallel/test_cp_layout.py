"""Context parallel's index logic, without processes, on hand-worked cases: the zigzag split, its
inverse, the attention work it balances, and the image shares of the vision tower."""

import pytest
import torch

from moevlm.parallel.cp_layout import (attention_work, balance_images, check_divisible, contiguous_positions,
                                       inverse_order, take_seq, zigzag_positions)


def test_zigzag_by_hand():
    # S = 8, cp = 2: chunks of 2 -> rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # S = 16, cp = 4: chunks of 2; rank r keeps chunk r and 7 - r
    assert [zigzag_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert contiguous_positions(8, 2, 1).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("S,cp", [(8, 2), (24, 4), (48, 3)])
def test_every_position_once_and_the_inverse(S, cp):
    every = torch.cat([zigzag_positions(S, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(S))
    x = torch.arange(S) * 10
    gathered = torch.cat([take_seq(x[None], zigzag_positions(S, cp, r))[0] for r in range(cp)])
    assert torch.equal(gathered[inverse_order(S, cp)], x)  # rank-order concatenation back to row order


def test_uneven_rows_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="cannot be cut into 2\\*cp = 4 equal chunks: set data.seq_len to a "
                                         "multiple of 4"):
        check_divisible(10, 2)
    with pytest.raises(ValueError):
        zigzag_positions(12, 4, 0)


def test_attention_work_by_hand():
    # one causal document of 8 tokens: query i sees i + 1 keys -> 1..8, total 36
    doc = torch.zeros(1, 8, dtype=torch.long)
    zig = [zigzag_positions(8, 2, r) for r in range(2)]
    naive = [contiguous_positions(8, 2, r) for r in range(2)]
    assert attention_work(doc, zig) == [1 + 2 + 7 + 8, 3 + 4 + 5 + 6] == [18, 18]  # balanced exactly
    assert attention_work(doc, naive) == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8] == [10, 26]
    # two documents [0, 4) and [4, 8): each query sees its document's earlier keys
    doc2 = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    assert attention_work(doc2, zig) == [1 + 2 + 3 + 4, 3 + 4 + 1 + 2] == [10, 10]
    assert attention_work(doc2, zig, causal=False) == [16, 16]


def test_images_balanced_largest_first():
    assert balance_images([64, 16, 16, 32], 2) == [[0], [1, 2, 3]]  # 64 vs 16 + 16 + 32
    assert balance_images([4, 4, 4], 2) == [[0, 2], [1]]
    assert balance_images([], 2) == [[], []]
    assert balance_images([8], 3) == [[0], [], []]  # a rank without an image still runs its tower (padding)
