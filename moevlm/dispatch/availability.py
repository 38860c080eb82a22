"""Can the DeepEP / HybridEP dispatchers run here, and with this layout?  (docs/dispatchers.md)

    reason = unavailable_reason("deepep")                      # None: runs; else one clause, why not
    problem = deepep_layout_problem(ep=16, num_experts=128)    # None: DeepEP takes this EP group

Three facts, reported in this order: the package (`probe_package`: located without importing it,
imported only when found, an import that fails reported in its own words), a class the backend can
drive, and moevlm's adapter registered in `moevlm.dispatch.DISPATCHERS`.  The layout rules are pure
functions of the EP size, the expert count and the ranks per node.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from moevlm.dispatch.base import DISPATCHERS

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
        f"{DEEPEP_URL}, then pip install . in the clone (HYBRID_EP_MULTINODE=1 pip install . for an EP group "
        "spanning more than one NVLink domain)"
    ),
}
DEEPEP_INTRANODE = (2, 4, 8)  # ranks of one DeepEP V1 group within a node
DEEPEP_NODE = 8  # ranks per node of an internode DeepEP V1 group (its NVLink peers)
# the EP sizes DeepEP V1 has tuned configs for (upstream deep_ep/buffers/legacy.py): no other size runs
DEEPEP_V1_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
HYBRIDEP_ALIGN = 4  # HybridEP: experts-per-rank x ranks-per-node must be a multiple of this
HYBRIDEP_MAX_NVLINK = 72  # the largest NVLink domain HybridEP detects
# HybridEP's NVLink domain when HYBRIDEP_DOMAIN_ENV is not set (HybridEP detects it; 8 is an H100/H200 node)
HYBRIDEP_DEFAULT_DOMAIN = 8
HYBRIDEP_DOMAIN_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"  # what HybridEP reads
HYBRIDEP_OLD_DOMAIN_ENV = "NVLINK_DOMAIN_SIZE"  # what it read before Dec 2025, now ignored


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
    # any error: the loader's ImportError / OSError, or DeepEP's own import-time asserts
    except Exception as err:  # noqa: BLE001
        return PackageStatus(True, f"{type(err).__name__}: {err}")
    return PackageStatus(True, classes=tuple(c for c in REPORTED if hasattr(module, c)))


def adapter_built(backend: str) -> bool:
    """Is moevlm's dispatcher for `backend` registered (moevlm.dispatch.DISPATCHERS)?"""
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
    """The NVLink domain HybridEP assumes for this launch: NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, which
    HybridEP itself reads (its EP ranks in one NVLink domain: e.g. 16 for EP16 within an NVL72 rack), else 8
    (HybridEP detects the domain then; 8 is an H100/H200 node, the common case we cannot probe here)."""
    value = os.environ.get(HYBRIDEP_DOMAIN_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else HYBRIDEP_DEFAULT_DOMAIN


def hybridep_env_problem() -> str | None:
    """The old NVLink-domain variable set without the new one: HybridEP would silently ignore it."""
    old = os.environ.get(HYBRIDEP_OLD_DOMAIN_ENV)
    if old is None or HYBRIDEP_DOMAIN_ENV in os.environ:
        return None
    return (
        f"{HYBRIDEP_OLD_DOMAIN_ENV}={old} is set, but HybridEP no longer reads it: export "
        f"{HYBRIDEP_DOMAIN_ENV}={old} instead (HybridEP's EP ranks per NVLink domain), and unset "
        f"{HYBRIDEP_OLD_DOMAIN_ENV}"
    )


def launch_ranks_per_node() -> int | None:
    """Ranks per node of this launch (torchrun's LOCAL_WORLD_SIZE), None when not launched so."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() else None


def deepep_layout_problem(
    ep: int, num_experts: int, ranks_per_node: int | None = None, api: str = "v2"
) -> str | None:
    """Why DeepEP (normal mode) cannot take an EP group of `ep` ranks, or None.  Both APIs: at least 2 ranks,
    the experts split evenly; V2 (`api="v2"`) asks nothing more (it spans NVLink domains of any size, e.g.
    GB200 trays of 4 GPUs).  V1 (`api="v1"`): one of the sizes it has configs for (DEEPEP_V1_SIZES), within
    a node 2, 4 or 8 ranks, across nodes 8 ranks on each node.  `ranks_per_node`: the launch's
    (LOCAL_WORLD_SIZE); None takes a group of up to 8 ranks as one node's."""
    if ep < 2:
        return f"DeepEP needs an expert-parallel group of at least 2 ranks (parallel.ep={ep}); it never runs on one"
    if num_experts % ep:
        return f"DeepEP splits the experts evenly: num_experts={num_experts} is not a multiple of parallel.ep={ep}"
    if api == "v2":
        return None
    if ep not in DEEPEP_V1_SIZES:
        return (
            f"DeepEP V1 (Buffer) runs EP groups of {', '.join(map(str, DEEPEP_V1_SIZES))} ranks only "
            f"(parallel.ep={ep}); DeepEP V2 (ElasticBuffer, model.deepep_api=v2) takes any size"
        )
    within = ep <= (DEEPEP_NODE if ranks_per_node is None else ranks_per_node)
    if within and ep not in DEEPEP_INTRANODE:
        return f"DeepEP V1 within a node takes 2, 4 or 8 ranks (parallel.ep={ep})"
    if not within and (ep % DEEPEP_NODE or (ranks_per_node or DEEPEP_NODE) < DEEPEP_NODE):
        per_node = "" if ranks_per_node is None else f", {ranks_per_node} ranks per node"
        return (
            f"DeepEP V1 across nodes takes a multiple of {DEEPEP_NODE} ranks, {DEEPEP_NODE} on each node "
            f"(parallel.ep={ep}{per_node}); DeepEP V2 (model.deepep_api=v2) takes this layout"
        )
    return None


def deepep_rules_api(api: str, check_package: bool = True) -> str:
    """The DeepEP API whose layout rules apply to `api`: the one named, else ("auto") V2 where the installed
    deep_ep has ElasticBuffer, V1 where it has not; V2 without looking at the package (`check_package=False`:
    what "auto" takes from a current build)."""
    if api != "auto":
        return api
    if not check_package:
        return "v2"
    return "v2" if DEEPEP_API_CLASS["v2"] in probe_package().classes else "v1"


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


# the node size each rule takes on this machine: DeepEP's NVLink peers are the launch's ranks per node,
# HybridEP's the NVLink domain it is told of
LAUNCH_NODE_SIZE = {"deepep": launch_ranks_per_node, "hybridep": hybridep_domain_size}
