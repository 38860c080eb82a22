"""An optimizer over a shadow module of masters (host copies, fp32 masters of bf16 weights) that
quacks as the optimizer the trainer uses, its AdamW `inner` stepping the shadow's parameters.

    class HostOffloadAdamW(ShadowOptimizer): ...     # builds self.model, self.shadow, self.inner
"""

from __future__ import annotations

import torch.nn as nn


class ShadowOptimizer:
    """`param_groups`, `defaults`, the step hooks and the state dict are `inner`'s (what the lr
    schedule drives and a checkpoint holds); a subclass sets `model`, `shadow` and `inner` and
    writes `state`, `step` and `zero_grad`."""

    model: nn.Module
    shadow: nn.Module
    inner: object  # a torch.optim.Optimizer over `shadow`'s parameters

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def register_step_post_hook(self, hook):
        return self.inner.register_step_post_hook(hook)

    def register_step_pre_hook(self, hook):
        return self.inner.register_step_pre_hook(hook)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def register_shadow(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """`param` at dotted `name` under `root`, making the empty modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, param)


__all__ = ["ShadowOptimizer", "register_shadow"]
