"""PlanMode's op-cache key (FakeTensorMode's cache, its key built cheaper): two calls share a cached
output only when nothing their outputs depend on differs.  Each pair below differs in one thing a
fake tensor or a scalar argument carries; identical arguments share a key."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import _CacheKeyState

from moevlm.plan.environments import fake_cuda
from moevlm.plan.fake import PlanMode

aten = torch.ops.aten


def _key(mode, func, *args):
    return mode._cache_key(_CacheKeyState(mode.shape_env), func, args, {})


def _bases(mode):
    """x (4, 6), big (5, 6), c (4, 6) complex, and x's twin on fake CUDA."""
    x = mode.fake(torch.randn(4, 6), torch.device("cpu"))
    big = mode.fake(torch.randn(5, 6), torch.device("cpu"))
    c = mode.fake(torch.randn(4, 6, dtype=torch.complex64), torch.device("cpu"))
    with fake_cuda():
        on_cuda = mode.fake(torch.randn(4, 6), torch.device("cuda", 0))
    return x, big, c, on_cuda


# name -> (args, args of the same op differing in `name` alone), from _bases
VARIANTS = {
    "dtype": lambda x, big, c, cu: ((x, x), (x.int(), x.int())),  # the same bytes per element
    "shape": lambda x, big, c, cu: ((x, x), (x[:3], x[:3])),
    "stride": lambda x, big, c, cu: ((x.t(), x.t()), (x.t().contiguous(), x.t().contiguous())),
    "storage offset": lambda x, big, c, cu: ((x[:3], x[:3]), (x[1:], x[1:])),
    "storage bytes": lambda x, big, c, cu: ((x[:4], x[:4]), (big[:4], big[:4])),
    "requires grad": lambda x, big, c, cu: ((x, x), (x.clone().requires_grad_(), x)),
    "conj": lambda x, big, c, cu: ((c, c), (c.conj(), c)),
    "neg": lambda x, big, c, cu: ((c.imag, c.imag), (c.conj().imag, c.conj().imag)),
    "device": lambda x, big, c, cu: ((x, x), (cu, cu)),
    "int or float scalar": lambda x, big, c, cu: ((x, 1), (x, 1.0)),
    "int or bool scalar": lambda x, big, c, cu: ((x, 1), (x, True)),
    "scalar value": lambda x, big, c, cu: ((x, 1), (x, 2)),
    "list length": lambda x, big, c, cu: ((x, [0]), (x, [0, 1])),
}


@pytest.fixture(scope="module")
def mode():
    with PlanMode() as m:
        yield m


def _op(args):
    if isinstance(args[1], list):
        return aten.sum.dim_IntList
    return aten.add.Tensor if isinstance(args[1], torch.Tensor) else aten.add.Scalar


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_difference_in_one_thing_is_a_different_key(mode, name):
    a, b = VARIANTS[name](*_bases(mode))
    func = _op(a)
    assert _key(mode, func, *a) == _key(mode, func, *a)
    assert _key(mode, func, *a) != _key(mode, func, *b), name


def test_equal_arguments_share_a_key_and_the_cached_output_is_right(mode):
    x = mode.fake(torch.randn(4, 6), torch.device("cpu"))
    y = mode.fake(torch.randn(4, 6), torch.device("cpu"))
    assert _key(mode, aten.add.Tensor, x, x) == _key(mode, aten.add.Tensor, y, y)
    hits = type(mode).cache_hits
    for a in (x, y, x.t(), y.t(), x[1:], y[1:]):
        out = a * 2
        # (a dense input's layout is kept by an elementwise op)
        assert (out.shape, out.stride(), out.dtype, out.device) == (
            a.shape,
            a.stride(),
            a.dtype,
            a.device,
        )
    assert type(mode).cache_hits > hits
    v = x.t()[1:]  # a view: its output shares the input's storage, also when cached
    assert v.untyped_storage().nbytes() == x.untyped_storage().nbytes()
    w = y.t()[1:]
    assert w.untyped_storage() is not v.untyped_storage()
    assert w.untyped_storage().nbytes() == y.untyped_storage().nbytes()
