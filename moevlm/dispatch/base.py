"""The token-dispatcher interface every backend implements.

Legend: T tokens on this rank, K top-k, D hidden, E experts in the model,
L experts on this rank (E for the local dispatcher), M rows after dispatch.

    expert_x_MD, tokens_per_expert_L, handle = d.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    expert_y_MD = experts(expert_x_MD, tokens_per_expert_L)
    y_TD = d.combine(expert_y_MD, handle)

Contract (DISPATCHERS.md):
- Routing comes in as top-k indices (int64) and fp32 weights; `dense_routing`
  gives the (T, E) bool map + probs form for backends that need it (HybridEP).
- `dispatch` returns rows grouped by local expert, in expert order, and a
  *tensor* of rows per local expert (no host copy unless a backend forces one).
- **Router weights are applied in `combine`, exactly once**, to the expert
  output before the per-token sum (the reference multiplies after the down
  projection, which is the same function).  `dispatch` never scales rows.
- `handle` is opaque to the caller: whatever the backend needs to invert the
  permutation (and, for collectives, to run backward through the same plan).
- `preprocess(topk_idx_TK, topk_w_TK)` is the routing-only part of `dispatch`
  that comes before any exchange or host sync (the local permutation plan):
  tensors of static shape, or None where a backend has no such part.  A backend
  calls it through `self.preprocess` inside `dispatch`, so a wrapper can replace
  it on the instance (a CUDA graph: moevlm.parallel.cuda_graphs) while the MoE
  layer keeps calling `dispatch` alone.
- A backend whose runtime package is missing, or whose constraints are not met,
  says so from `unavailable_reason`; `build_dispatcher` turns that into an error
  naming the package or constraint, or into the configured fallback, logged once.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

log = logging.getLogger(__name__)


class TokenDispatcher(ABC):
    name: ClassVar[str]

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts = num_experts
        self.top_k = top_k

    @classmethod
    def unavailable_reason(cls, **kwargs) -> str | None:
        """Why this backend cannot run with these arguments here, or None."""
        return None

    def preprocess(self, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Routing -> the plan tensors `dispatch` starts from (static shapes, no host sync); None: none."""
        return None

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_w_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ...

    @abstractmethod
    def combine(self, expert_y_MD: torch.Tensor, handle: Any) -> torch.Tensor:
        ...


def dense_routing(topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as a (T, E) bool map and (T, E) fp32 probabilities."""
    probs_TE = torch.zeros(topk_idx_TK.shape[0], num_experts, dtype=torch.float32, device=topk_idx_TK.device)
    probs_TE.scatter_(1, topk_idx_TK, topk_w_TK.float())
    routing_map_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, topk_idx_TK, True)
    return routing_map_TE, probs_TE


def group_max_tokens(group, num_tokens: int, device) -> int:
    """The largest token count any rank of `group` dispatches now, for backends that size a buffer or an
    all-gather by it (DeepEP V2, HybridEP): a functional all-reduce (selective recompute reuses it) and one
    host read."""
    from torch.distributed._functional_collectives import all_reduce

    return int(all_reduce(torch.tensor([num_tokens], dtype=torch.int64, device=device), "max", group)[0])


DISPATCHERS: dict[str, type[TokenDispatcher]] = {}
_fallbacks_logged: set[tuple[str, str]] = set()


def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    DISPATCHERS[cls.name] = cls
    return cls


def build_dispatcher(name: str, *, fallback: str | None = None, **kwargs) -> TokenDispatcher:
    """Construct dispatcher `name`; if it cannot run here, raise with the reason, or
    build `fallback` instead (logged once per pair)."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {sorted(DISPATCHERS)}")
    reason = DISPATCHERS[name].unavailable_reason(**kwargs)
    if reason is None:
        return DISPATCHERS[name](**kwargs)
    if fallback is None:
        raise RuntimeError(f"dispatcher {name!r} cannot run: {reason}")
    if (name, fallback) not in _fallbacks_logged:
        _fallbacks_logged.add((name, fallback))
        log.warning("dispatcher %r cannot run (%s); falling back to %r as configured", name, reason, fallback)
    return build_dispatcher(fallback, **kwargs)
