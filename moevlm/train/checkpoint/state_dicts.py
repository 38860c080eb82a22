"""What a checkpoint writes and what its load fills: the nested state dict handed to DCP.

    {"model": {fqn: tensor or DTensor}, "optim": {"state.<fqn>.exp_avg": ..., ...},
     "extra": {"<name>": uint8 JSON, "<name>.<i>": tensor},              (rank 0 writes it)
     "per_rank": {"rank<r>": {"<name>": uint8 JSON, "<name>.<i>": tensor}}}

Model and optimizer go through DCP's state-dict API in the storage layout
(moevlm.parallel.weights.to_storage_layout); extra and per-rank values through `values`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from moevlm.parallel.weights import to_storage_layout
from moevlm.train.checkpoint.keys import check_model_keys, check_optimizer_keys, require
from moevlm.train.checkpoint.values import put, stored_value, value_template

# Optimizer state flattened per parameter name ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): it loads
# whatever the parameter groups of the loading layout are (they are split by device mesh).
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizer_view(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """The (module, optimizer) pair DCP's optimizer state dict is taken from: an offloaded optimizer
    (moevlm.parallel.optimizer_offload) names its host masters by the model's parameter names, so the
    state dict is in the same format as the device optimizer's."""
    view = getattr(optimizer, "checkpoint_view", None)
    return view() if view is not None else (model, optimizer)


def _model_state(model: torch.nn.Module, optimizer: Any, trainable: bool) -> dict[str, Any]:
    """The model's state dict (`trainable`: without the frozen parameters, a LoRA run's base); under
    fp32 masters of bf16 weights (moevlm.parallel.master_weights) the trained parameters' entries are
    the masters, so a checkpoint holds the fp32 values."""
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable))
    masters = getattr(optimizer, "master_module", None)
    if masters is not None:
        state.update(get_model_state_dict(masters()))
    return state


def state_to_save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict,
    per_rank: dict,
    rank: int,
    trainable: bool = False,
) -> dict[str, Any]:
    """The state dict rank `rank` hands dcp.save (`trainable`: the model's trainable entries alone)."""
    model_sd = _model_state(model, optimizer, trainable)
    optim_sd = (
        get_optimizer_state_dict(*_optimizer_view(model, optimizer), options=_OPTIM)
        if optimizer is not None
        else None
    )
    model_sd, optim_sd = to_storage_layout(model_sd, optim_sd)
    state: dict[str, Any] = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    if extra and rank == 0:
        state["extra"] = {}
        for name, v in extra.items():
            put(state["extra"], name, stored_value(v, f"extra.{name}"))
    if per_rank:
        mine: dict[str, torch.Tensor] = {}
        for name, v in per_rank.items():
            put(mine, name, stored_value(v, f"per_rank.rank{rank}.{name}"))
        state["per_rank"] = {f"rank{rank}": mine}
    return state


def load_template(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict,
    names: list[str],
    marker: dict,
    saved: Mapping[str, Any],
    path: Path,
    rank: int,
    keys_of_every_rank: Callable[[Mapping[str, Any]], set[str]],
    trainable: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What dcp.load fills (our model/optimizer state dicts in the storage layout, and
    byte placeholders), and the state dicts those views write into.  Checked against the
    checkpoint's index `saved` first; `keys_of_every_rank` is collective."""
    originals: dict[str, Any] = {"model": _model_state(model, optimizer, trainable)}
    if optimizer is not None:
        originals["optim"] = get_optimizer_state_dict(
            *_optimizer_view(model, optimizer), options=_OPTIM
        )
    model_sd, optim_sd = to_storage_layout(originals["model"], originals.get("optim"))
    state: dict[str, Any] = {"model": model_sd}
    check_model_keys(state["model"], saved, path, keys_of_every_rank(state["model"]))
    if optim_sd is not None:
        state["optim"] = optim_sd
        check_optimizer_keys(state["optim"], saved, path)
    if extra:
        require(extra, saved, "extra", path)
        state["extra"] = {}
        for n in extra:
            put(state["extra"], n, value_template(saved, f"extra.{n}", path))
    require(names, saved, "per_rank.rank0", path)
    if names and rank < marker["world_size"]:
        mine: dict[str, torch.Tensor] = {}
        for n in names:
            put(mine, n, value_template(saved, f"per_rank.rank{rank}.{n}", path))
        state["per_rank"] = {f"rank{rank}": mine}
    return state, originals


def set_loaded(
    state: dict[str, Any],
    originals: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable: bool = False,
) -> None:
    """Put what dcp.load filled into `model` and `optimizer` (the tensors were filled through the
    storage views; DCP replaced the non-tensor values, lr, betas..., in the dict it was given);
    `trainable`: the frozen parameters are not among them and keep their values."""
    for name in ("model", "optim"):
        for k, v in state.get(name, {}).items():
            if not isinstance(v, torch.Tensor):
                originals[name][k] = v
    set_model_state_dict(
        model,
        originals["model"],
        options=StateDictOptions(ignore_frozen_params=trainable, strict=not trainable),
    )
    if optimizer is not None:
        set_optimizer_state_dict(
            *_optimizer_view(model, optimizer), originals["optim"], options=_OPTIM
        )
        if hasattr(optimizer, "load_masters"):  # host masters follow the loaded weights
            optimizer.load_masters()
        if hasattr(optimizer, "masters_loaded"):  # bf16 weights follow the loaded masters
            optimizer.masters_loaded()
