"""The dispatcher registry, the `DispatcherSpec` a job builds its MoE blocks with, and what the
distributed backends share.

Legend: T tokens on this rank, K top-k, D hidden, E experts in the model,
L experts on this rank (E for the local dispatcher), M rows after dispatch.

    expert_x_MD, tokens_per_expert_L, handle = d.dispatch(x_TD, topk_idx_TK, topk_w_TK)
    expert_y_MD = experts(expert_x_MD, tokens_per_expert_L)
    y_TD = d.combine(expert_y_MD, handle)

The interface (`TokenDispatcher`) is the model's, moevlm.model.dispatcher; docs/dispatchers.md
describes every backend.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

from moevlm.model.dispatcher import TokenDispatcher


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
DEEPEP_APIS = ("auto", "v2", "v1")  # the deepep backend's DeepEP API (moevlm.dispatch.deepep)


# backend -> the class a plan builds instead of it (moevlm.dispatch.modelled): the gated backends
MODELS: dict[str, type[TokenDispatcher]] = {}


def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    DISPATCHERS[cls.name] = cls
    return cls


def register_model(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    MODELS[cls.name] = cls
    return cls


class ModelledBuffers:
    """The buffers a plan's modelled backends hold, one per EP group as the packages keep them (one job's
    build: `DispatcherSpec.for_plan` makes a new one)."""

    def __init__(self):
        self.held: dict[str, torch.Tensor] = {}  # EP group name -> the buffer (uint8)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.held.values())


def dispatcher_names() -> tuple[str, ...]:
    """The registered names in a fixed order (`local`, the default, then alphabetical), whatever order
    the modules were imported or registered in: --help, the configuration reference and validation
    messages list them so."""
    return tuple(sorted(DISPATCHERS, key=lambda name: (name != "local", name)))


def build_dispatcher(name: str, **kwargs) -> TokenDispatcher:
    """Construct dispatcher `name`; RuntimeError with the reason if it cannot run here."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {list(dispatcher_names())}")
    reason = DISPATCHERS[name].unavailable_reason(**kwargs)
    if reason is not None:
        raise RuntimeError(f"dispatcher {name!r} cannot run: {reason}")
    return DISPATCHERS[name](**kwargs)


@dataclass(frozen=True)
class DispatcherSpec:
    """The dispatcher every MoE block is built with: a registered backend and its options (chosen once
    for a job by moevlm.config.choose_dispatcher).  `build` makes one block's dispatcher; the MoE
    config gives the expert count, top-k, the permute backend and the capacity mode."""

    name: str = "local"
    api: str = "auto"  # deepep: which DeepEP API drives it (DEEPEP_APIS)
    num_sms: int = 0  # deepep / hybridep: SMs of their kernels; 0 = the backend's choice
    # deepep (V2) / hybridep: a static bound on any rank's tokens (no all-reduce of token counts)
    max_tokens_per_rank: int | None = None
    # a plan's only (`for_plan`): build the backend's model (MODELS), holding its buffers here
    plan_buffers: ModelledBuffers | None = field(default=None, compare=False)

    def for_plan(self) -> DispatcherSpec:
        """The spec a plan builds (moevlm.plan.dry_run): a gated backend (deepep, hybridep) as its model,
        moevlm.dispatch.modelled (the package is never imported), with buffers of its own; any other as
        it is."""
        return replace(self, plan_buffers=ModelledBuffers()) if self.name in MODELS else self

    @property
    def modelled(self) -> bool:
        return self.plan_buffers is not None

    def build(self, moe, ep_group=None, etp_group=None) -> TokenDispatcher:
        """Block's dispatcher for MoE config `moe` over the expert groups (None: one process); the
        backend takes those of these arguments its constructor has.  A `for_plan` spec builds the model."""
        offered = {
            "permute": moe.permute,
            "ep_group": ep_group,
            "etp_group": etp_group,
            "api": self.api,
            "num_sms": self.num_sms,
            "max_tokens_per_rank": self.max_tokens_per_rank,
        }
        if moe.capacity_factor is not None:
            offered.update(
                capacity_factor=moe.capacity_factor, capacity_overflow=moe.capacity_overflow
            )
        if self.plan_buffers is not None:  # a model takes every argument of its real adapter
            return MODELS[self.name](moe.num_experts, moe.top_k, self.plan_buffers, **offered)
        taken = constructor_arguments(self.name)
        kwargs = {key: value for key, value in offered.items() if key in taken}
        return build_dispatcher(self.name, num_experts=moe.num_experts, top_k=moe.top_k, **kwargs)


def constructor_arguments(name: str) -> frozenset[str]:
    """The keyword arguments backend `name`'s constructor takes."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {list(dispatcher_names())}")
    return frozenset(inspect.signature(DISPATCHERS[name]).parameters)
