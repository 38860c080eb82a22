"""Optimizer offload (`parallel.optimizer_offload=true`): the optimizer state in host memory, the
AdamW step on the CPU.  Under FSDP2 it is FSDP's `CPUOffloadPolicy` (`fsdp_offload_policy`, applied
by moevlm.parallel.data_parallel) with the ordinary optimizer over the host shards; under DDP and
one process it is `HostOffloadAdamW`: fp32 host masters and AdamW state, gradients copied in,
updated weights copied back in place.  Why: docs/architecture.md.

    opt = build_optimizer(model, job.optim, offload=True)   # HostOffloadAdamW (DDP, one process)
    ...backward, ctx.finish_gradients(), ctx.clip_grad_norm_(...)...
    opt.step()      # grads device->host, AdamW on the host masters, weights host->device
    opt.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from moevlm.parallel.data_parallel import local_tensor
from moevlm.parallel.shadow_optimizer import ShadowOptimizer, register_shadow


def fused_adamw_available(device: torch.device) -> bool:
    """Whether this torch has a fused AdamW kernel for `device`'s type."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # private helper moved: foreach is always available
        return False


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor of `param`'s kind: a DTensor with `param`'s spec (mesh, placements, global
    shape) whose local tensor stays where it is (DTensor.from_local would move it to the mesh's
    device), or `local` itself."""
    if isinstance(param, DTensor):
        return DTensor(local, param._spec, requires_grad=False)
    return local


def offload_kind(enabled: bool, world: int, dp_mode: str) -> str | None:
    """parallel.optimizer_offload's mechanism for a layout: "fsdp" (FSDP2's CPU offload policy: FSDP over
    several processes), "host" (HostOffloadAdamW: DDP or one process), None when off."""
    if not enabled:
        return None
    return "fsdp" if world > 1 and dp_mode == "fsdp" else "host"


def pin_host_memory() -> bool:
    """Whether host buffers should be pinned: only with an accelerator to copy to."""
    return torch.cuda.is_available()


def _host_empty(like: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=torch.float32, device="cpu", pin_memory=pin)


class HostOffloadAdamW(ShadowOptimizer):
    """AdamW over host fp32 masters of `model`'s trainable parameters (see the module docstring).
    Quacks as the optimizer the trainer uses: `param_groups`, `state`, `step()`, `zero_grad()`,
    `register_step_post_hook`, `state_dict()` / `load_state_dict()`."""

    def __init__(self, model: nn.Module, make_adamw, pin: bool | None = None):
        """`make_adamw(module)`: the device optimizer's constructor applied to a module (so the groups
        and flags are the ones `build_optimizer` makes)."""
        self.model = model
        if pin is None:  # pinned only when the parameters are on an accelerator
            first = next((p for p in model.parameters() if p.requires_grad), None)
            pin = first is not None and local_tensor(first).is_cuda and pin_host_memory()
        self.pin = pin
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = nn.Module()
        self._masters: list[torch.Tensor] = []  # host local tensors, in `names` order
        self._grads: list[torch.Tensor] = []  # host gradient buffers (local), same order
        self._params: list[nn.Parameter] = []  # the shadow's parameters
        # the model's trainable parameters, same order: held as a torch optimizer holds its params
        named = dict(model.named_parameters())
        self._device = [named[name] for name in self.names]
        for name, p in zip(self.names, self._device):
            master = _host_empty(local_tensor(p), self.pin)
            master.copy_(local_tensor(p).detach())
            param = nn.Parameter(_like(p, master), requires_grad=True)
            register_shadow(self.shadow, name, param)
            self._masters.append(master)
            self._grads.append(_host_empty(local_tensor(p), self.pin))
            self._params.append(param)
        self.inner = make_adamw(self.shadow)

    # ----------------------------------------------------------- optimizer API
    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for p in self._params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOffloadAdamW.step takes no closure")
        cuda = False
        for device, grad, param in zip(self._device, self._grads, self._params):
            g = device.grad
            if g is None:  # not used this step: the device optimizer skips it too
                param.grad = None
                continue
            local = local_tensor(g)
            cuda |= local.is_cuda
            grad.copy_(local, non_blocking=self.pin)
            param.grad = _like(param, grad)
        if cuda:  # the gradients are on the host before the CPU reads them
            torch.cuda.current_stream().synchronize()
        self.inner.step()
        for device, master in zip(self._device, self._masters):
            local_tensor(device).copy_(master, non_blocking=self.pin)

    # ------------------------------------------------------------- checkpoints
    def checkpoint_view(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(module, optimizer) whose DCP optimizer state dict is this optimizer's, in the device
        optimizer's format (the model's names and placements)."""
        return self.shadow, self.inner

    @torch.no_grad()
    def load_masters(self) -> None:
        """Read the masters back from the model's parameters (after a checkpoint load)."""
        for device, master in zip(self._device, self._masters):
            master.copy_(local_tensor(device).detach())

    # ------------------------------------------------------------------ sizes
    def host_bytes(self) -> dict[str, int]:
        """Host bytes of this rank: masters, gradient buffers, AdamW state."""
        state = sum(
            local_tensor(v).numel() * local_tensor(v).element_size()
            for s in self.inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return {
            "masters": sum(m.numel() * m.element_size() for m in self._masters),
            "grads": sum(g.numel() * g.element_size() for g in self._grads),
            "state": state,
        }


def fsdp_offload_policy(pin: bool | None = None):
    """FSDP2's CPU offload policy (sharded parameters, gradients and optimizer state on the host), with
    pinned memory where an accelerator is present and the policy accepts the option."""
    import inspect

    from torch.distributed.fsdp import CPUOffloadPolicy

    pin = pin_host_memory() if pin is None else pin
    if "pin_memory" in inspect.signature(CPUOffloadPolicy).parameters:
        return CPUOffloadPolicy(pin_memory=pin)
    return CPUOffloadPolicy()


__all__ = ["HostOffloadAdamW", "fsdp_offload_policy", "offload_kind", "pin_host_memory"]
