"""What a dry run runs inside: the fake process group of any size, the symmetric world's object
exchange, fake `cuda` tensors on a CPU-only build, autocast as the trainer sets it.

    with fake_world(world=8, rank=3), symmetric_objects():   # collectives issued, nothing moved
        ...
    with fake_cuda(), PlanMode():                          # a forward through the CUDA code paths
        ...
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def symmetric_objects():
    """`dist.all_gather_object` as the symmetric world answers it (every rank's object is this one's):
    torch pickles objects through tensors, which fake tensors cannot give bytes for."""
    saved = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.all_gather_object = saved


@contextlib.contextmanager
def fake_world(world: int, rank: int):
    """The `fake` process group of `world` ranks, this process being `rank` (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world <= 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a plan needs its own process group: this process already has one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _guard_registry():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return (ctypes.c_void_p * 64).in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")


_CUDA, _META = 1, 14  # c10::DeviceType


@contextlib.contextmanager
def fake_cuda():
    """Fake `cuda` tensors usable for a forward without gradients on a CPU-only build
    (docs/architecture.md).  On a build with CUDA nothing changes."""
    saved = {}
    registry = None
    if not torch.backends.cuda.is_built():
        registry = _guard_registry()
        if not registry[_CUDA]:
            registry[_CUDA] = registry[_META]
        else:
            registry = None
        for name in ("__int__", "__float__", "__bool__", "__index__"):
            saved[name] = FakeTensor.__dict__.get(name)
        FakeTensor.__int__ = lambda self: int(self.item())
        FakeTensor.__float__ = lambda self: float(self.item())
        FakeTensor.__bool__ = lambda self: bool(self.item())
        FakeTensor.__index__ = lambda self: int(self.item())
    try:
        yield
    finally:
        for name, f in saved.items():
            if f is None:
                delattr(FakeTensor, name)
            else:
                setattr(FakeTensor, name, f)
        if registry is not None:
            registry[_CUDA] = None


@contextlib.contextmanager
def emulated_autocast(device_type: str, dtype: torch.dtype | None):
    """Autocast for `device_type` as the trainer sets it (`torch.autocast` refuses CUDA on a build
    without it; the C++ switch underneath does not)."""
    if dtype is None:
        yield
        return
    was, was_dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, was)
        torch.set_autocast_dtype(device_type, was_dtype)
        torch.clear_autocast_cache()
