"""The training objective of one micro-batch, as every rank and every pipeline schedule forms it.

    loss = objective(lm_sum, loss_tokens, aux, aux_coef, aux_divisor)
    loss.backward()

Design choices:
- The LM term is the micro-batch's summed token loss over the step's global count of loss tokens
  (every micro-batch, every data-parallel rank): every token weighs the same whatever the packing,
  accumulation or layout, and the gradient sums over micro-batches and ranks (each data-parallel
  reduction sums) give the step's mean.
- The aux (load-balancing) loss is formed per micro-batch, as in Megatron and the reference, and
  averaged over the step's micro-batches and data-parallel ranks: `aux_divisor` = micro-batches x dp.
  The router z-loss (moe.z_loss_coeff) is averaged the same way.
- One function for the whole-model path (the trainer) and a pipeline's last stage, so both compute
  the same numbers in the same order; `aux` is None without MoE layers.
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
