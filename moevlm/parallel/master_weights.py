"""Mixed-precision weights (`optim.master_weights=true`): the model's parameters in bf16, fp32 masters of
this rank's shards held by the optimizer, as Megatron's distributed optimizer keeps them.

    cast_parameters_(model, torch.bfloat16)                  # in build_model, before FSDP
    opt = MasterWeightsAdamW(model, make_adamw)              # moevlm.train.optim.build_optimizer
    ...backward (bf16 gradients), ctx.finish_gradients(), clipping...
    opt.step()       # AdamW on the masters, reading the bf16 gradients; masters rounded into the weights

The AdamW (moevlm.train.adamw) reads each gradient through `grad_of` and upcasts it per chunk, so no
fp32 copy of the gradients is made.  A checkpoint's model entries of trained parameters are the masters
(`master_module`), so a resume is exact and checkpoints load across `master_weights` settings.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from moevlm.parallel.data_parallel import local_tensor
from moevlm.parallel.shadow_optimizer import ShadowOptimizer, register_shadow

# wrapper modules' attribute names, left out of the masters' names (as DCP's state dicts leave them out)
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def model_state_bytes(master_weights: bool, state_dtype: str = "float32") -> tuple[int, int]:
    """(trained, frozen) bytes a parameter keeps: the weight, its gradient (in the weight's dtype), the
    fp32 master (`master_weights`) and AdamW's two moments (optim.state_dtype); a frozen one its weight."""
    weight = 2 if master_weights else 4
    moments = 2 * (2 if state_dtype == "bfloat16" else 4)
    return weight + weight + (4 if master_weights else 0) + moments, weight


def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter of `model` replaced by one of `dtype` (on the meta device before
    FSDP: the shards are then made in `dtype`); a parameter held twice stays one.  Buffers keep theirs."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]


def _as_param_of(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` laid out as `p` (a DTensor of p's mesh, placements and global shape, in local's dtype),
    or `local` itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
        )
    return local


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


class MasterWeightsAdamW(ShadowOptimizer):
    """AdamW over fp32 masters of `model`'s trained (bf16) parameters; see the module docstring.
    Quacks as the optimizer the trainer uses: `param_groups`, `state`, `step()`, `zero_grad()`,
    `register_step_post_hook`, `state_dict()` / `load_state_dict()`; `inner` is the AdamW over the
    masters (what the lr schedule drives)."""

    def __init__(self, model: nn.Module, make_adamw):
        """`make_adamw(module, grad_of)`: moevlm's AdamW over `module`'s parameters (the groups
        `build_optimizer` makes), reading each one's gradient as `grad_of(param)`."""
        self.model = model
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = nn.Module()  # the masters, by the model's (state-dict) names
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model param, master)
        self._model_param: dict[nn.Parameter, nn.Parameter] = {}  # master -> model param
        for name, p in trained:
            local = local_tensor(p).detach()
            master = nn.Parameter(
                _as_param_of(p, local.to(torch.float32, copy=True)), requires_grad=True
            )
            register_shadow(self.shadow, _clean(name), master)
            self._pairs.append((p, master))
            self._model_param[master] = p
        self.inner = make_adamw(self.shadow, self._grad_of)

    def _grad_of(self, master: torch.Tensor) -> torch.Tensor | None:
        """The model parameter's (bf16) gradient; the master's own where it has none (DCP's state
        initialisation steps the masters with zero gradients)."""
        g = self._model_param[master].grad
        return g if g is not None else master.grad

    # ----------------------------------------------------------- optimizer API
    @property
    def state(self) -> dict:
        """A read-only view: the AdamW state of each master, with the master itself (`master`), so the
        bytes the optimizer holds are all listed."""
        return {m: {**self.inner.state.get(m, {}), "master": m} for _, m in self._pairs}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        self.inner.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightsAdamW.step takes no closure")
        self.inner.step()
        self.copy_down()

    @torch.no_grad()
    def copy_down(self) -> None:
        """Each master rounded (to nearest) into its model parameter."""
        for p, master in self._pairs:
            local_tensor(p).copy_(local_tensor(master))

    # ------------------------------------------------------------- checkpoints
    def checkpoint_view(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(module, optimizer) whose DCP optimizer state dict is this optimizer's, in the plain
        optimizer's format (the model's names and placements)."""
        return self.shadow, self.inner

    def master_module(self) -> nn.Module:
        """The module of the masters: its state dict replaces the model's entries of the trained
        parameters in a checkpoint (moevlm.train.checkpoint.state_dicts)."""
        return self.shadow

    def masters_loaded(self) -> None:
        """After a checkpoint load filled the masters: the model's weights follow them."""
        self.copy_down()


__all__ = ["MasterWeightsAdamW", "cast_parameters_", "model_state_bytes"]
