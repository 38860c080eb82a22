"""The dispatcher registry, its availability gate, and what the distributed backends share.

Legend: T tokens on this rank, K top-k, D hidden, E experts in the model,
L experts on this rank (E for the local dispatcher), M rows after dispatch.

    expert_x_MD, tokens_per_expert_L, handle = d.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    expert_y_MD = experts(expert_x_MD, tokens_per_expert_L)
    y_TD = d.combine(expert_y_MD, handle)

The interface itself (`TokenDispatcher`, with the contract) is the model's:
`moevlm.model.dispatcher`, beside the single-process `LocalDispatcher`; docs/dispatchers.md
describes every backend.  Here: the registry, `build_dispatcher` with its availability gate
(a backend whose runtime package is missing, or whose constraints are not met, says so from
`unavailable_reason`; that becomes an error naming the package or constraint, or the
configured fallback, logged once), and helpers the distributed backends share.
"""

from __future__ import annotations

import logging

import torch

from moevlm.model.dispatcher import TokenDispatcher

log = logging.getLogger(__name__)


def dense_routing(
    topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as a (T, E) bool map and (T, E) fp32 probabilities."""
    probs_TE = torch.zeros(
        topk_idx_TK.shape[0], num_experts, dtype=torch.float32, device=topk_idx_TK.device
    )
    probs_TE.scatter_(1, topk_idx_TK, topk_w_TK.float())
    routing_map_TE = torch.zeros_like(probs_TE, dtype=torch.bool).scatter_(1, topk_idx_TK, True)
    return routing_map_TE, probs_TE


def group_max_tokens(group, num_tokens: int, device) -> int:
    """The largest token count any rank of `group` dispatches now, for backends that size a buffer or an
    all-gather by it (DeepEP V2, HybridEP): a functional all-reduce (selective recompute reuses it) and one
    host read."""
    from torch.distributed._functional_collectives import all_reduce

    return int(
        all_reduce(torch.tensor([num_tokens], dtype=torch.int64, device=device), "max", group)[0]
    )


def token_bound(
    group, num_tokens: int, device, max_tokens_per_rank: int | None, backend: str
) -> int:
    """The bound on any rank's token count that DeepEP V2 and HybridEP size their buffers by: the
    dispatcher's static `max_tokens_per_rank` when given (no collective; more tokens here is an
    error), else the group's largest count now (`group_max_tokens`)."""
    if max_tokens_per_rank is None:
        return group_max_tokens(group, num_tokens, device)
    if num_tokens > max_tokens_per_rank:
        raise ValueError(
            f"{num_tokens} tokens on this rank exceed the {backend} dispatcher's "
            f"max_tokens_per_rank={max_tokens_per_rank}"
        )
    return max_tokens_per_rank


DISPATCHERS: dict[str, type[TokenDispatcher]] = {}
_fallbacks_logged: set[tuple[str, str]] = set()


def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    DISPATCHERS[cls.name] = cls
    return cls


def dispatcher_names() -> tuple[str, ...]:
    """The registered names in a fixed order (`local`, the default, then alphabetical), whatever order
    the modules were imported or registered in: --help, conf/README.md and validation messages list them so."""
    return tuple(sorted(DISPATCHERS, key=lambda name: (name != "local", name)))


def build_dispatcher(name: str, *, fallback: str | None = None, **kwargs) -> TokenDispatcher:
    """Construct dispatcher `name`; if it cannot run here, raise with the reason, or
    build `fallback` instead (logged once per pair)."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {list(dispatcher_names())}")
    reason = DISPATCHERS[name].unavailable_reason(**kwargs)
    if reason is None:
        return DISPATCHERS[name](**kwargs)
    if fallback is None:
        raise RuntimeError(f"dispatcher {name!r} cannot run: {reason}")
    if (name, fallback) not in _fallbacks_logged:
        _fallbacks_logged.add((name, fallback))
        log.warning(
            "dispatcher %r cannot run (%s); falling back to %r as configured",
            name,
            reason,
            fallback,
        )
    return build_dispatcher(fallback, **kwargs)
