"""AdamW whose moments are held in a narrower dtype (`optim.state_dtype=bfloat16`), updated in fp32.

    opt = AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, state_dtype=torch.bfloat16)

Per chunk of tensors the moments (and any non-fp32 parameter or gradient) are read up to fp32, updated
with the arithmetic of torch's foreach AdamW (the same ops in the same order: with fp32 state the result
is torch's, bit for bit), and written back rounded to nearest even (no stochastic rounding).  The state
keys (`step`, `exp_avg`, `exp_avg_sq`) are torch's, so checkpoints load across both.
"""

from __future__ import annotations

import torch

from moevlm.parallel.data_parallel import local_tensor

CHUNK_ELEMS = 1 << 26  # elements upcast at once: bounds the fp32 temporaries of a step
# the flags of torch's foreach AdamW's parameter groups (this step's arithmetic): checkpoints of either
# optimizer hold the same keys, so each resumes the other's
TORCH_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": True,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam with moments in `state_dtype` (see the module docstring)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
        chunk_elems: int = CHUNK_ELEMS,
        grad_of=None,
    ):
        """`grad_of(param)`: where a parameter's gradient is read (default its `.grad`; the bf16
        weights' gradients for fp32 masters: moevlm.parallel.master_weights)."""
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, **TORCH_FLAGS})
        self.state_dtype = state_dtype
        self.chunk_elems = chunk_elems
        self.grad_of = grad_of or _own_grad

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts floating state to each parameter's dtype: the moments are put back in
        `state_dtype` (exact for moments saved in it)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):  # DTensors of p's layout when p is one
                state[key] = torch.zeros_like(
                    p, dtype=self.state_dtype, memory_format=torch.preserve_format
                )
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rows = []  # (param, grad, exp_avg, exp_avg_sq, step): local tensors
            for p in group["params"]:
                grad = self.grad_of(p)
                if grad is None:
                    continue
                s = self._state_of(p)
                rows.append(
                    (
                        local_tensor(p),
                        local_tensor(grad),
                        local_tensor(s["exp_avg"]),
                        local_tensor(s["exp_avg_sq"]),
                        s["step"],
                    )
                )
            for chunk in _chunks(rows, self.chunk_elems):
                _update(chunk, group)
        return loss


def _own_grad(p: torch.Tensor) -> torch.Tensor | None:
    return p.grad


def _chunks(rows: list, limit: int):
    out, n = [], 0
    for row in rows:
        if out and n + row[0].numel() > limit:
            yield out
            out, n = [], 0
        out.append(row)
        n += row[0].numel()
    if out:
        yield out


def _up(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 views of `ts`: the tensors themselves where fp32, else fp32 copies."""
    return [t if t.dtype == torch.float32 else t.float() for t in ts]


def _down(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Write the fp32 results back where `_up` copied (round to nearest even)."""
    for d, s in zip(dst, src):
        if d is not s:
            d.copy_(s)


def _update(rows: list, group: dict) -> None:
    """One AdamW update of `rows`, torch's foreach arithmetic (torch.optim.adam._multi_tensor_adam,
    not capturable) in fp32."""
    params, grads, exp_avgs, exp_avg_sqs, steps = (list(c) for c in zip(*rows))
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    p32, g32, m32, v32 = _up(params), _up(grads), _up(exp_avgs), _up(exp_avg_sqs)
    for s in steps:
        s += 1
    if wd != 0:
        torch._foreach_mul_(p32, 1 - lr * wd)
    torch._foreach_lerp_(m32, g32, 1 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, 1 - beta2)
    del g32
    step_size = [(lr / (1 - beta1 ** s.item())) * -1 for s in steps]
    bias_correction2_sqrt = [(1 - beta2 ** s.item()) ** 0.5 for s in steps]
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p32, m32, denom, step_size)
    _down(params, p32)
    _down(exp_avgs, m32)
    _down(exp_avg_sqs, v32)


__all__ = ["AdamW"]
