"""Can the DeepEP / HybridEP dispatchers run here, and with this layout?  (docs/dispatchers.md)

    reason = unavailable_reason("deepep")                      # None: runs; else one clause, why not
    problem = deepep_layout_problem(ep=16, num_experts=128)    # None: DeepEP takes this EP group

Design choices:
- Nothing heavy at import: `deep_ep` is located with `importlib.util.find_spec` and imported only when a
  spec exists, so a machine without it (every CPU machine) never tries; no CUDA is needed to answer.  A
  build that exists but cannot load (ImportError / OSError from a CUDA build made for another machine) is
  reported with the loader's own words, not as "missing".
- Three separate facts, reported in this order: the package (installed? importable?), a class the
  backend can use (DeepEP: V2's `ElasticBuffer` or V1's `Buffer`, or the one the deepep adapter's `api`
  names; `HybridEPBuffer` from DeepEP's `hybrid-ep` branch), and whether moevlm's adapter for that backend
  is registered in `moevlm.dispatch.DISPATCHERS` (both are: moevlm/dispatch/deepep.py, either API, and
  moevlm/dispatch/hybridep.py).  A missing package also says when the adapter is missing, so no one
  builds DeepEP only to meet the next refusal.
- The layout rules are pure functions of the EP size, the expert count and the ranks per node, checked
  by config validation before anything is allocated and, later, by the adapters' `unavailable_reason`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

PACKAGE = "deep_ep"
DEEPEP_URL = "https://github.com/deepseek-ai/DeepEP"
DEEPEP_API_CLASS = {
    "v2": "ElasticBuffer",
    "v1": "Buffer",
}  # the deepep adapter's `api` -> the class it drives
# backend -> the deep_ep classes any one of which it can use (deepep: in the order `api="auto"` prefers them)
CLASSES = {"deepep": tuple(DEEPEP_API_CLASS.values()), "hybridep": ("HybridEPBuffer",)}
REPORTED = ("Buffer", "ElasticBuffer", "HybridEPBuffer")  # what a probe lists
INSTALL = {
    "deepep": (
        f"DeepEP is built from source against CUDA: git clone {DEEPEP_URL}, then pip install . in the "
        "clone, with NCCL >= 2.30.4 for V2's ElasticBuffer and NVSHMEM for V1's internode and low-latency "
        "modes; the PyPI deep-ep is only a stub"
    ),
    "hybridep": (
        f"HybridEP is DeepEP's hybrid-ep branch, built from source against CUDA: git clone -b hybrid-ep "
        f"{DEEPEP_URL}, then pip install . in the clone"
    ),
}
DEEPEP_INTRANODE = (2, 4, 8)  # ranks of one DeepEP group within a node
DEEPEP_NODE = 8  # ranks per node of an internode DeepEP group (its NVLink peers)
HYBRIDEP_ALIGN = 4  # HybridEP: experts-per-rank x ranks-per-node must be a multiple of this
HYBRIDEP_MAX_NVLINK = 72  # the largest NVLink domain HybridEP detects
HYBRIDEP_DEFAULT_DOMAIN = 8  # HybridEP's NVLink domain when NVLINK_DOMAIN_SIZE is not set


@dataclass(frozen=True)
class PackageStatus:
    """What this machine has of `deep_ep`: installed (a spec is found), the import error if it does not
    load, and which of the backends' classes it offers."""

    installed: bool
    error: str | None = None
    classes: tuple[str, ...] = ()


def probe_package(name: str = PACKAGE) -> PackageStatus:
    """Locate `name` without importing it; import it only when it exists (every class any backend needs)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:  # ValueError: a module in sys.modules with no __spec__
        return PackageStatus(True, f"{type(err).__name__}: {err}")
    if spec is None:
        return PackageStatus(False)
    try:
        module = importlib.import_module(name)
    except (ImportError, OSError) as err:  # e.g. a CUDA extension built for another CUDA / torch
        return PackageStatus(True, f"{type(err).__name__}: {err}")
    return PackageStatus(True, classes=tuple(c for c in REPORTED if hasattr(module, c)))


def adapter_built(backend: str) -> bool:
    """Is moevlm's dispatcher for `backend` registered (moevlm.dispatch.DISPATCHERS)?"""
    from moevlm.dispatch import DISPATCHERS

    return backend in DISPATCHERS


def unavailable_reason(backend: str, check_package: bool = True, api: str = "auto") -> str | None:
    """Why `backend` ("deepep" or "hybridep") cannot run on this machine, as one clause, or None.
    `check_package=False` looks at moevlm alone (a recipe checked for another machine); `api` ("v1" or
    "v2", deepep only) asks for that DeepEP API's class rather than either."""
    if backend not in CLASSES:
        raise ValueError(f"unknown backend {backend!r}; one of {sorted(CLASSES)}")
    if api != "auto" and (backend != "deepep" or api not in DEEPEP_API_CLASS):
        raise ValueError(
            f"api={api!r} for {backend!r}; only deepep takes one: auto or one of "
            f"{list(DEEPEP_API_CLASS)}"
        )
    built = adapter_built(backend)
    not_built = f"moevlm's {backend} adapter is not built yet"
    if not check_package:
        return None if built else not_built
    status = probe_package()
    if not status.installed:
        return f"the {PACKAGE} package is not installed ({INSTALL[backend]})" + (
            "" if built else f", and moevlm's {backend} adapter is not built yet either"
        )
    if status.error is not None:
        return (
            f"the {PACKAGE} package is installed but does not import ({status.error}): a build for another "
            f"CUDA or torch; rebuild it on this machine ({INSTALL[backend]})"
        )
    wanted = CLASSES[backend] if api == "auto" else (DEEPEP_API_CLASS[api],)
    have = [c for c in wanted if c in status.classes]
    if not have:
        asked = (
            ""
            if api == "auto"
            else (
                f" (the deepep dispatcher's api={api!r} drives it; api='auto' takes "
                f"whichever of {' or '.join(CLASSES[backend])} is there)"
            )
        )
        return f"the installed {PACKAGE} package has no {' or '.join(wanted)}{asked} ({INSTALL[backend]})"
    return (
        None
        if built
        else f"the {PACKAGE} package is installed (it offers {', '.join(have)}) but {not_built}"
    )


# ----------------------------------------------------------------- layouts
def hybridep_domain_size() -> int:
    """The NVLink domain HybridEP assumes for this launch: NVLINK_DOMAIN_SIZE, which HybridEP itself reads
    (set it to 72 on an NVL72 rack), else HybridEP's default of 8."""
    value = os.environ.get("NVLINK_DOMAIN_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else HYBRIDEP_DEFAULT_DOMAIN


def launch_ranks_per_node() -> int | None:
    """Ranks per node of this launch (torchrun's LOCAL_WORLD_SIZE), None when not launched so."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else None


def deepep_layout_problem(
    ep: int, num_experts: int, ranks_per_node: int | None = None
) -> str | None:
    """Why DeepEP (normal mode) cannot take an EP group of `ep` ranks, or None: within a node 2, 4 or 8
    ranks, across nodes a multiple of 8 with 8 ranks on each node, never one rank; the experts split
    evenly.  These are V1's rules, kept for V2 too (its sources assert only the even split; what else its
    kernels take is not established here).  `ranks_per_node`: the launch's (LOCAL_WORLD_SIZE); None takes
    a group of up to 8 ranks as one node's."""
    if ep < 2:
        return f"DeepEP needs an expert-parallel group of at least 2 ranks (parallel.ep={ep}); it never runs on one"
    if num_experts % ep:
        return f"DeepEP splits the experts evenly: num_experts={num_experts} is not a multiple of parallel.ep={ep}"
    within = ep <= (DEEPEP_NODE if ranks_per_node is None else ranks_per_node)
    if within and ep not in DEEPEP_INTRANODE:
        return f"DeepEP within a node takes 2, 4 or 8 ranks (parallel.ep={ep})"
    if not within and (ep % DEEPEP_NODE or (ranks_per_node or DEEPEP_NODE) < DEEPEP_NODE):
        per_node = "" if ranks_per_node is None else f", {ranks_per_node} ranks per node"
        return (
            f"DeepEP across nodes takes a multiple of {DEEPEP_NODE} ranks, {DEEPEP_NODE} on each node "
            f"(parallel.ep={ep}{per_node})"
        )
    return None


def hybridep_layout_problem(
    ep: int,
    num_experts: int,
    ranks_per_node: int | None = None,
    tokens_per_chunk: int | None = None,
) -> str | None:
    """Why HybridEP cannot take an EP group of `ep` ranks, or None: at least 2 ranks, the experts split
    evenly, and with R the group's ranks in one NVLink domain (min(ep, ranks_per_node), the domain's size
    being `hybridep_domain_size()` on this machine; ep when unknown), experts-per-rank x R and
    tokens-per-chunk x R (when given: the adapter's setting) are multiples of 4; R is at most 72."""
    if ep < 2:
        return f"HybridEP needs an expert-parallel group of at least 2 ranks (parallel.ep={ep})"
    if num_experts % ep:
        return f"HybridEP splits the experts evenly: num_experts={num_experts} is not a multiple of parallel.ep={ep}"
    local, nvl = num_experts // ep, min(ep, ranks_per_node or ep)
    if nvl > HYBRIDEP_MAX_NVLINK:
        return f"HybridEP's NVLink domain holds at most {HYBRIDEP_MAX_NVLINK} ranks ({nvl} here)"
    if local * nvl % HYBRIDEP_ALIGN:
        return (
            f"HybridEP needs experts-per-rank x ranks-per-node to be a multiple of {HYBRIDEP_ALIGN} "
            f"({local} x {nvl} = {local * nvl}; parallel.ep={ep}, num_experts={num_experts})"
        )
    if tokens_per_chunk is not None and tokens_per_chunk * nvl % HYBRIDEP_ALIGN:
        return (
            f"HybridEP needs tokens-per-chunk x ranks-per-node to be a multiple of {HYBRIDEP_ALIGN} "
            f"({tokens_per_chunk} x {nvl})"
        )
    return None


LAYOUT_PROBLEMS = {"deepep": deepep_layout_problem, "hybridep": hybridep_layout_problem}
# the node size each rule takes on this machine: DeepEP's NVLink peers are the launch's ranks per node,
# HybridEP's the NVLink domain it is told of
LAUNCH_NODE_SIZE = {"deepep": launch_ranks_per_node, "hybridep": hybridep_domain_size}
