"""The local dispatcher on hand-worked routings, its inverse, and the registry's
availability gate."""

import pytest
import torch

from moevlm.dispatch import (
    DISPATCHERS,
    LocalDispatcher,
    TokenDispatcher,
    build_dispatcher,
    dense_routing,
)


def test_dispatch_groups_rows_by_expert_in_token_order():
    d = LocalDispatcher(num_experts=4, top_k=2)
    x_TD = torch.arange(3.0)[:, None].expand(3, 2) * 10  # token t has value 10t
    topk_idx = torch.tensor([[2, 0], [0, 3], [2, 0]])
    topk_w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    expert_x, counts, handle = d.dispatch(x_TD, topk_idx, topk_w)
    # expert 0 <- tokens 0, 1, 2; expert 1 <- none; expert 2 <- tokens 0, 2; expert 3 <- token 1
    assert counts.tolist() == [3, 0, 2, 1]
    assert expert_x[:, 0].tolist() == [0, 10, 20, 0, 20, 10]
    assert handle.token_idx_N.tolist() == [0, 1, 2, 0, 2, 1]
    assert handle.weight_N.tolist() == pytest.approx([0.3, 0.6, 0.5, 0.7, 0.5, 0.4])


def test_combine_applies_weights_once_and_sums_choices():
    d = LocalDispatcher(num_experts=4, top_k=2)
    x_TD = torch.randn(5, 3)
    topk_idx = torch.tensor([[1, 3], [0, 1], [3, 2], [1, 0], [2, 3]])
    topk_w = torch.rand(5, 2)
    expert_x, counts, handle = d.dispatch(x_TD, topk_idx, topk_w)
    # expert e multiplies by e+1
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0]).repeat_interleave(counts)[:, None]
    y = d.combine(expert_x * scale, handle)
    expected = ((topk_idx + 1).float() * topk_w).sum(1, keepdim=True) * x_TD
    torch.testing.assert_close(y, expected)


def test_gradients_reach_inputs_and_router_weights():
    d = LocalDispatcher(num_experts=3, top_k=2)
    x = torch.randn(4, 2, requires_grad=True)
    w = torch.rand(4, 2, requires_grad=True)
    idx = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    ex, counts, h = d.dispatch(x, idx, w)
    d.combine(ex * 2, h).sum().backward()
    torch.testing.assert_close(x.grad, 2 * w.detach().sum(1, keepdim=True).expand(4, 2))
    torch.testing.assert_close(w.grad, 2 * x.detach().sum(1, keepdim=True).expand(4, 2))


def test_dense_routing_map_and_probs():
    routing_map, probs = dense_routing(
        torch.tensor([[2, 0], [1, 2]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]]), 3
    )
    assert routing_map.tolist() == [[True, False, True], [False, True, True]]
    assert probs.tolist() == [[0.25, 0.0, 0.75], [0.0, 0.5, 0.5]]


class _NeedsPackage(TokenDispatcher):
    name = "needs_package_for_test"

    @classmethod
    def unavailable_reason(cls, **kwargs):
        return "the package 'deep_ep' is not installed"

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        raise AssertionError("never built")

    def combine(self, expert_y_MD, handle):
        raise AssertionError("never built")


def test_unavailable_backend_fails_naming_the_package():
    """(The fallback a job asks for, model.dispatcher_fallback, is chosen with the dispatcher, once:
    moevlm.config.dispatcher; tests/dispatch/test_availability.py.)"""
    DISPATCHERS[_NeedsPackage.name] = _NeedsPackage
    try:
        with pytest.raises(RuntimeError, match="deep_ep"):
            build_dispatcher(_NeedsPackage.name, num_experts=4, top_k=2)
    finally:
        del DISPATCHERS[_NeedsPackage.name]
    with pytest.raises(ValueError, match="unknown dispatcher"):
        build_dispatcher("nccl_magic", num_experts=4, top_k=2)


def test_names_are_listed_in_one_order_whatever_the_registration_order(monkeypatch):
    from moevlm.dispatch import dispatcher_names

    before = dispatcher_names()
    assert before[0] == "local" and list(before[1:]) == sorted(before[1:])
    monkeypatch.delitem(DISPATCHERS, "deepep")  # re-inserted last when monkeypatch restores it
    monkeypatch.undo()
    assert list(DISPATCHERS)[-1] == "deepep" and dispatcher_names() == before
