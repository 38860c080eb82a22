"""The training objective of one micro-batch, as every rank and every pipeline schedule forms it.

    loss = objective(lm_sum, loss_tokens, aux, aux_coef, aux_divisor)
    loss.backward()

The LM term is the summed token loss over the step's global count of loss tokens; the aux
(load-balancing) and z-loss terms are averaged over `aux_divisor` = micro-batches x dp.  `aux` is
None without MoE layers.
"""

from __future__ import annotations

import torch


def objective(
    lm_sum: torch.Tensor,
    loss_tokens: float,
    aux: torch.Tensor | None,
    aux_coef: float,
    aux_divisor: int,
    z: torch.Tensor | None = None,
    z_coef: float = 0.0,
) -> torch.Tensor:
    """lm_sum / loss_tokens + aux_coef * aux / aux_divisor + z_coef * z / aux_divisor (the second
    term only with an aux loss, the third only with a z-loss)."""
    loss = lm_sum / loss_tokens
    if aux is not None:
        loss = loss + aux_coef * aux / aux_divisor
    if z is not None:
        loss = loss + z_coef * z / aux_divisor
    return loss
