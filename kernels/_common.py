"""What every Triton kernel module here shares: the one import of triton, interpreter detection, launch
sizes and the checks before a launch.

    from moevlm.kernels._common import triton, tl     # None, None when triton is not installed
    from moevlm.kernels import _common as common      # common.INTERPRET read at call time (tests patch it)
    @common.jit                                       # triton.jit, or the plain function without triton
    triton_mod = common.require_triton("permute backend='triton'")   # raises, naming the package

`INTERPRET`: TRITON_INTERPRET=1 as it was when moevlm.kernels was first imported (set it before).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as e:
    if e.name != "triton":
        raise
    triton = tl = None

__all__ = [
    "FLOAT_DTYPES",
    "INTERPRET",
    "INTERPRET_PROGRAMS",
    "KernelDeviceError",
    "autotune_configs",
    "cdiv",
    "jit",
    "num_programs",
    "require_kernel_device",
    "require_triton",
    "tl",
    "triton",
]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET_PROGRAMS = 4
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels take as data


class KernelDeviceError(RuntimeError, ValueError):
    """A Triton kernel asked for on tensors it cannot run on (CPU without the interpreter).  Both a
    RuntimeError and a ValueError: the kernel modules raised one or the other before."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (host side; `tl.cdiv` inside kernels)."""
    return -(-a // b)


def jit(fn):
    """triton.jit when triton imports; without it the function stays plain Python and is never launched."""
    return triton.jit(fn) if triton is not None else fn


def require_triton(what: str):
    """The triton module, or a ModuleNotFoundError saying that `what` needs it."""
    if triton is None:
        raise ModuleNotFoundError(
            f"{what} needs the `triton` package (pip install triton); use backend='torch' "
            "without it",
            name="triton",
        )
    return triton


def require_kernel_device(what: str, *tensors: torch.Tensor) -> None:
    """Refuse tensors off CUDA unless the kernels run under the interpreter."""
    if not INTERPRET and any(t.device.type != "cuda" for t in tensors):
        raise KernelDeviceError(
            f"{what} runs on CUDA tensors, or on CPU only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before moevlm.kernels is imported"
        )


def autotune_configs(
    tiles: list[tuple[int, ...]], names: tuple[str, ...], interpret_tile: tuple[int, ...]
):
    """triton.Configs from tiles (the `names` block sizes, then num_warps, num_stages); under the interpreter
    only `interpret_tile` (nothing to benchmark there)."""
    n = len(names)
    tiles = [interpret_tile] if INTERPRET else tiles
    return [
        triton.Config(dict(zip(names, t[:n])), num_warps=t[n], num_stages=t[n + 1]) for t in tiles
    ]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM of `device`, INTERPRET_PROGRAMS under the interpreter."""
    if INTERPRET:
        return INTERPRET_PROGRAMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
