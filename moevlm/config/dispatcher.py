"""The one choice of the token dispatcher: `model.dispatcher` and its options, the layout and this
machine -> the `DispatcherSpec` every MoE block is built with.

    reason = gate(job.model, environment)              # deepep / hybridep: why they cannot run here
    spec, notes = choose_dispatcher(job.model, moe, dims, reason, environment)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moevlm.dispatch import DispatcherSpec, dispatcher_names
from moevlm.dispatch.availability import (
    CLASSES,
    LAUNCH_NODE_SIZE,
    deepep_layout_problem,
    deepep_rules_api,
    hybridep_env_problem,
    hybridep_layout_problem,
    unavailable_reason,
)
from moevlm.errors import Problems, check

if TYPE_CHECKING:
    from moevlm.config.model_section import ModelConfig
    from moevlm.model.config import MoEConfig
    from moevlm.parallel.mesh import ParallelDims

GATED = tuple(CLASSES)  # the backends that need a deep_ep class (moevlm.dispatch.availability)


def gate(m: ModelConfig, environment: bool) -> str | None:
    """Why a gated backend (deepep, hybridep) cannot run: its package on this machine (with
    `environment`), then moevlm's adapter.  ConfigError unless model.dispatcher_fallback says what runs
    instead; then the reason, for the note.  Checked before the layout: such a job cannot run at all."""
    if m.dispatcher not in GATED:
        return None
    api = m.deepep_api if m.dispatcher == "deepep" else "auto"
    reason = unavailable_reason(m.dispatcher, check_package=environment, api=api)
    check(reason is None or m.dispatcher_fallback != "none", _refusal(m.dispatcher, reason))
    return reason


def choose_dispatcher(
    m: ModelConfig,
    moe: MoEConfig,
    dims: ParallelDims,
    unavailable: str | None = None,
    environment: bool = True,
) -> tuple[DispatcherSpec, list[str]]:
    """The dispatcher every MoE block runs, and the notes for the log.  `auto` is `local` when no token
    leaves its rank (ep x etp == 1), else `alltoall`; an explicit name wins unless it cannot run here
    (`unavailable`, or its layout rules) and model.dispatcher_fallback names what runs instead.  Then the
    backend that is built: over several processes with ep x etp == 1 `local` (the capacity all-to-all
    over a group of one when model.moe_capacity_factor is set); with experts split, `alltoall` where
    `local` was named; one process: the name as chosen."""
    problems = Problems()
    problems.run(_check_name, m, dims)
    problems.run(_check_options, m)
    unavailable = unavailable or problems.run(
        _layout_problem, m, dims, moe.num_experts, environment
    )
    name, notes = _resolve(m, dims, unavailable)
    problems.run(_check_capacity, m, name, dims)
    problems.raise_any()
    spec = DispatcherSpec(
        name=_built(name, dims, moe.capacity_factor),
        api=m.deepep_api,
        num_sms=m.dispatcher_num_sms,
        max_tokens_per_rank=m.dispatcher_max_tokens_per_rank,
    )
    return spec, notes


def _resolve(m: ModelConfig, dims: ParallelDims, unavailable: str | None) -> tuple[str, list[str]]:
    if unavailable is not None and m.dispatcher_fallback != "none":
        return m.dispatcher_fallback, [
            f"note: model.dispatcher={m.dispatcher} cannot run: {unavailable}; running the "
            f"{m.dispatcher_fallback} dispatcher instead (model.dispatcher_fallback="
            f"{m.dispatcher_fallback})"
        ]
    if m.dispatcher != "auto":
        return m.dispatcher, []
    if dims.ep * dims.etp == 1:
        return "local", []
    return "alltoall", [
        f"model.dispatcher=auto chose alltoall: parallel.ep x etp = {dims.ep} x {dims.etp} > 1 "
        "moves tokens between ranks"
    ]


def _built(name: str, dims: ParallelDims, capacity_factor: float | None) -> str:
    if dims.world == 1:
        return name
    if dims.ep * dims.etp > 1:
        return "alltoall" if name == "local" else name
    return "local" if capacity_factor is None else "alltoall"


def _check_name(m: ModelConfig, dims: ParallelDims) -> None:
    names = dispatcher_names()
    check(
        m.dispatcher == "auto" or m.dispatcher in names,
        f"model.dispatcher={m.dispatcher!r}; choose auto or one of {list(names)}",
    )
    check(
        m.dispatcher != "local" or dims.ep == 1,
        f"parallel.ep={dims.ep} moves tokens between ranks: model.dispatcher='local' cannot; choose "
        "alltoall (or auto)",
    )


def _check_options(m: ModelConfig) -> None:
    check(
        m.dispatcher_max_tokens_per_rank is None or m.dispatcher_max_tokens_per_rank > 0,
        f"model.dispatcher_max_tokens_per_rank={m.dispatcher_max_tokens_per_rank} must be > 0, or "
        "None (null)",
    )
    check(
        m.dispatcher_num_sms >= 0 and m.dispatcher_num_sms % 2 == 0,
        f"model.dispatcher_num_sms={m.dispatcher_num_sms} must be even and >= 0 (0: the backend's "
        "choice)",
    )


def _check_capacity(m: ModelConfig, name: str, dims: ParallelDims) -> None:
    """model.moe_capacity_factor is a mode of the alltoall and hybridep dispatchers, without ETP
    (moevlm.dispatch.capacity, moevlm.dispatch.hybridep)."""
    if m.moe_capacity_factor is None:
        return
    check(
        name in ("alltoall", "hybridep"),
        f"model.moe_capacity_factor={m.moe_capacity_factor} is a mode of the alltoall and hybridep "
        f"dispatchers but the dispatcher is {name!r}; set model.dispatcher=alltoall, or "
        "model.moe_capacity_factor=null",
    )
    check(
        dims.etp == 1,
        f"model.moe_capacity_factor={m.moe_capacity_factor} is not built with parallel.etp="
        f"{dims.etp} > 1; use parallel.etp=1, or model.moe_capacity_factor=null (dropless)",
    )


def _layout_problem(
    m: ModelConfig, dims: ParallelDims, num_experts: int, environment: bool
) -> str | None:
    """A gated backend's rank and expert-count rules (moevlm.dispatch.availability) under this layout;
    the node size is this machine's when `environment` (DeepEP: the launch's LOCAL_WORLD_SIZE;
    HybridEP: NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, default 8), else unknown.  DeepEP's rules are
    those of the API that will run (model.deepep_api).  HybridEP's old NVLINK_DOMAIN_SIZE, which it no
    longer reads, is refused with the new name whatever the fallback."""
    if m.dispatcher not in GATED or not num_experts:
        return None
    node = LAUNCH_NODE_SIZE[m.dispatcher]() if environment else None
    if m.dispatcher == "deepep":
        api = deepep_rules_api(m.deepep_api, environment)
        problem = deepep_layout_problem(dims.ep, num_experts, node, api)
    else:
        env = hybridep_env_problem() if environment else None
        check(env is None, f"model.dispatcher='hybridep': {env}")
        problem = hybridep_layout_problem(dims.ep, num_experts, node)
    check(problem is None or m.dispatcher_fallback != "none", _refusal(m.dispatcher, problem))
    return problem


def _refusal(name: str, reason: str) -> str:
    return (
        f"model.dispatcher={name!r} cannot run: {reason}; use model.dispatcher=alltoall, or "
        "model.dispatcher_fallback=alltoall to fall back to it"
    )
