"""The DeepEP / HybridEP availability gate (moevlm.dispatch.availability and config validation), on the CPU.

What a machine has of `deep_ep` is simulated: absent by hiding it from `find_spec`, present or broken by
putting one of the test doubles in fake_deep_ep/ (see its README; not DeepEP) first on sys.path.  A built
adapter is simulated by registering a test-double dispatcher under the backend's name.  The layout rules
are pure functions, checked on hand-worked cases.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job, validate
from moevlm.dispatch import DISPATCHERS
from moevlm.dispatch.availability import (
    deepep_layout_problem,
    hybridep_layout_problem,
    probe_package,
    unavailable_reason,
)
from moevlm.dispatch.hybridep import HybridEPDispatcher
from moevlm.dispatch.local import LocalDispatcher
from moevlm.errors import ConfigError

FAKES = Path(__file__).parent / "fake_deep_ep"
FALLBACK = "model.dispatcher_fallback=alltoall"
EP2 = ["parallel.ep=2", "train.global_batch_size=2"]


@pytest.fixture
def no_deep_ep(monkeypatch):
    """This machine without deep_ep, whatever is installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deep_ep" else real(name, *a)
    )
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)


@pytest.fixture
def fake_deep_ep(monkeypatch):
    """use(variant): the test double fake_deep_ep/<variant>/deep_ep is the deep_ep this process finds."""

    def use(variant: str) -> None:
        monkeypatch.syspath_prepend(str(FAKES / variant))
        monkeypatch.delitem(sys.modules, "deep_ep", raising=False)

    yield use
    # the fake's module object: monkeypatch then restores any real one
    sys.modules.pop("deep_ep", None)


class FakeAdapter(LocalDispatcher):
    """Test double: stands for a built deepep / hybridep adapter in the registry (never run here)."""


@pytest.fixture
def adapters_built(monkeypatch):
    for name in ("deepep", "hybridep"):
        monkeypatch.setitem(DISPATCHERS, name, FakeAdapter)


# ------------------------------------------------------------ the package missing
MISSING = {
    "deepep": (
        "model.dispatcher='deepep' cannot run: the deep_ep package is not installed (DeepEP is built from "
        "source against CUDA: git clone https://github.com/deepseek-ai/DeepEP, then pip install . in the "
        "clone, with NCCL >= 2.30.4 for V2's ElasticBuffer and NVSHMEM for V1's internode and low-latency "
        "modes; the PyPI deep-ep is only a stub); use model.dispatcher=alltoall, or "
        "model.dispatcher_fallback=alltoall to fall back to it"
    ),
    "hybridep": (
        "model.dispatcher='hybridep' cannot run: the deep_ep package is not installed (HybridEP is "
        "DeepEP's hybrid-ep branch, built from source against CUDA: git clone -b hybrid-ep "
        "https://github.com/deepseek-ai/DeepEP, then pip install . in the clone (HYBRID_EP_MULTINODE=1 pip "
        "install . for an EP group spanning more than one NVLink domain)); use "
        "model.dispatcher=alltoall, or model.dispatcher_fallback=alltoall to fall back to it"
    ),
}


INSTALL_DEEPEP = MISSING["deepep"].split("not installed (")[1].split("); use model.")[0]


@pytest.mark.parametrize("name", ["deepep", "hybridep"])
def test_missing_package_is_one_line_naming_package_install_and_fallback(no_deep_ep, name):
    # even with a launch that does not fit: this is said first, alone
    with pytest.raises(ConfigError) as err:
        validate(compose_job([f"model.dispatcher={name}", *EP2]), 5)
    assert str(err.value) == MISSING[name]
    assert probe_package().installed is False and "deep_ep" not in sys.modules


def test_missing_package_alone_with_a_built_adapter(no_deep_ep):
    """moevlm's deepep adapter is built (moevlm/dispatch/deepep.py): the package alone is named."""
    assert DISPATCHERS["deepep"].__module__ == "moevlm.dispatch.deepep"
    assert (
        unavailable_reason("deepep")
        == MISSING["deepep"].split("cannot run: ")[1].split("; use model.")[0]
    )
    assert "adapter" not in unavailable_reason("deepep")


@pytest.mark.parametrize("overrides, world", [([], 1), (EP2, 2)])
def test_fallback_runs_alltoall_with_exactly_one_note(no_deep_ep, overrides, world):
    plan = validate(compose_job(["model.dispatcher=deepep", FALLBACK, *overrides]), world)
    assert plan.dispatcher.name == "alltoall"
    notes = [n for n in plan.notes if "dispatcher" in n]
    assert notes == [
        f"note: model.dispatcher=deepep cannot run: {unavailable_reason('deepep')}; running the "
        "alltoall dispatcher instead (model.dispatcher_fallback=alltoall)"
    ]


def test_fallback_is_logged_once_by_a_trainer_run(no_deep_ep, tmp_path, capsys):
    from moevlm.train.trainer import Trainer

    job = compose_job(
        [
            "model.dispatcher=deepep",
            FALLBACK,
            "train.steps=2",
            "data.num_workers=0",
            "data.streams=1",
            "train.tensorboard=false",
            "train.checkpoint_at_end=false",
            f"train.run_dir={tmp_path}",
        ]
    )
    assert Trainer(job).run() == 0
    out = capsys.readouterr()
    assert (out.out + out.err).count("model.dispatcher_fallback=alltoall") == 1


def test_fallback_none_is_the_default_and_other_values_are_refused():
    assert compose_job([]).model.dispatcher_fallback == "none"
    with pytest.raises(
        ConfigError,
        match=r"model.dispatcher_fallback='local'; choose one of \['none', 'alltoall'\]",
    ):
        validate(compose_job(["model.dispatcher_fallback=local"]), 1)


def test_fallback_changes_nothing_for_a_dispatcher_that_runs():
    plan = validate(compose_job(["model.dispatcher=local", FALLBACK]), 1)
    assert plan.dispatcher.name == "local" and plan.notes == []


# ------------------------------------------- the package present (test doubles)
@pytest.fixture
def no_deepep_adapter(monkeypatch):
    """moevlm as it was before its deepep and hybridep adapters (the gate's words for an adapter not built)."""
    monkeypatch.delitem(DISPATCHERS, "deepep")
    monkeypatch.delitem(DISPATCHERS, "hybridep")


def test_present_package_without_our_adapter_says_not_built(fake_deep_ep, no_deepep_adapter):
    fake_deep_ep("full")
    assert probe_package().classes == ("Buffer", "ElasticBuffer", "HybridEPBuffer")
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["model.dispatcher=deepep", *EP2]), 2)
    assert str(err.value) == (
        "model.dispatcher='deepep' cannot run: the deep_ep package is installed (it offers "
        "ElasticBuffer, Buffer) but moevlm's deepep adapter is not built yet; use "
        "model.dispatcher=alltoall, or model.dispatcher_fallback=alltoall to fall back to it"
    )
    assert "not installed" not in str(err.value)
    assert unavailable_reason("hybridep") == (
        "the deep_ep package is installed (it offers HybridEPBuffer) but "
        "moevlm's hybridep adapter is not built yet"
    )


def test_main_branch_without_hybridep_names_the_branch(fake_deep_ep, adapters_built):
    fake_deep_ep("no_hybrid")
    assert unavailable_reason("deepep") is None  # Buffer: what the adapter uses
    assert unavailable_reason("hybridep") == (
        "the installed deep_ep package has no HybridEPBuffer (HybridEP is DeepEP's hybrid-ep branch, built from "
        "source against CUDA: git clone -b hybrid-ep https://github.com/deepseek-ai/DeepEP, then pip install . in "
        "the clone (HYBRID_EP_MULTINODE=1 pip install . for an EP group spanning more than one NVLink domain))"
    )


def test_v2_only_package_is_taken_unless_v1_is_asked(fake_deep_ep):
    """moevlm's deepep adapter drives V2's ElasticBuffer (moevlm/dispatch/deepep.py); api='v1' asks for Buffer."""
    fake_deep_ep("v2_only")
    assert probe_package().classes == ("ElasticBuffer",)
    assert unavailable_reason("deepep") is None and unavailable_reason("deepep", api="v2") is None
    assert validate(compose_job(["model.dispatcher=deepep", *EP2]), 2).dispatcher.name == "deepep"
    assert unavailable_reason("deepep", api="v1") == (
        "the installed deep_ep package has no Buffer (the deepep dispatcher's api='v1' drives it; api='auto' takes "
        f"whichever of ElasticBuffer or Buffer is there) ({INSTALL_DEEPEP})"
    )


def test_v1_only_package_is_taken_unless_v2_is_asked(fake_deep_ep):
    fake_deep_ep("v1_only")
    assert probe_package().classes == ("Buffer",)
    assert unavailable_reason("deepep") is None and unavailable_reason("deepep", api="v1") is None
    assert unavailable_reason("deepep", api="v2") == (
        "the installed deep_ep package has no ElasticBuffer (the deepep dispatcher's api='v2' drives it; api='auto' "
        f"takes whichever of ElasticBuffer or Buffer is there) ({INSTALL_DEEPEP})"
    )
    with pytest.raises(ValueError, match="api='v2' for 'hybridep'; only deepep takes one"):
        unavailable_reason("hybridep", api="v2")


def test_broken_cuda_build_is_reported_not_missing(fake_deep_ep):
    fake_deep_ep("broken_cuda")
    status = probe_package()
    assert status.installed and status.classes == ()
    assert (
        status.error
        == "OSError: libnvshmem_host.so.3: cannot open shared object file: No such file or directory"
    )
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["model.dispatcher=deepep", *EP2]), 2)
    assert str(err.value).splitlines() == [
        "model.dispatcher='deepep' cannot run: the deep_ep package is installed but does not import (OSError: "
        "libnvshmem_host.so.3: cannot open shared object file: No such file or directory): a build for another "
        f"CUDA or torch; rebuild it on this machine ({INSTALL_DEEPEP}); use model.dispatcher=alltoall, or "
        "model.dispatcher_fallback=alltoall to fall back to it"
    ]


def test_a_recipe_checked_for_another_machine_never_imports_deep_ep(fake_deep_ep, monkeypatch):
    fake_deep_ep("broken_cuda")  # importing it would raise
    # the adapter is built
    plan = validate(compose_job(["model.dispatcher=deepep", *EP2]), 2, environment=False)
    assert plan.dispatcher.name == "deepep" and "deep_ep" not in sys.modules
    monkeypatch.delitem(DISPATCHERS, "deepep")  # as before the adapter
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["model.dispatcher=deepep", *EP2]), 2, environment=False)
    assert str(err.value) == (
        "model.dispatcher='deepep' cannot run: moevlm's deepep adapter is not built yet; use "
        "model.dispatcher=alltoall, or model.dispatcher_fallback=alltoall to fall "
        "back to it"
    )
    assert "deep_ep" not in sys.modules


# ------------------------------------------------------------- layout rules
@pytest.mark.parametrize(
    "ep, experts, per_node, want",
    [
        (2, 8, None, None),
        (4, 8, None, None),
        (8, 64, None, None),
        (16, 128, None, None),
        (16, 128, 8, None),
        (32, 128, 8, None),
        (2, 8, 8, None),
        (
            1,
            8,
            None,
            "DeepEP needs an expert-parallel group of at least 2 ranks (parallel.ep=1); it never runs on one",
        ),
        (
            3,
            6,
            None,
            "DeepEP V1 (Buffer) runs EP groups of 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks only "
            "(parallel.ep=3); DeepEP V2 (ElasticBuffer, model.deepep_api=v2) takes any size",
        ),
        (
            6,
            12,
            8,
            "DeepEP V1 (Buffer) runs EP groups of 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks only "
            "(parallel.ep=6); DeepEP V2 (ElasticBuffer, model.deepep_api=v2) takes any size",
        ),
        (
            8,
            12,
            None,
            "DeepEP splits the experts evenly: num_experts=12 is not a multiple of parallel.ep=8",
        ),
        (
            12,
            24,
            None,
            "DeepEP V1 (Buffer) runs EP groups of 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks only "
            "(parallel.ep=12); DeepEP V2 (ElasticBuffer, model.deepep_api=v2) takes any size",
        ),
        (
            8,
            64,
            4,
            "DeepEP V1 across nodes takes a multiple of 8 ranks, 8 on each node (parallel.ep=8, 4 ranks per "
            "node); DeepEP V2 (model.deepep_api=v2) takes this layout",
        ),
        (
            16,
            128,
            4,
            "DeepEP V1 across nodes takes a multiple of 8 ranks, 8 on each node (parallel.ep=16, 4 ranks per "
            "node); DeepEP V2 (model.deepep_api=v2) takes this layout",
        ),
        (16, 128, 16, "DeepEP V1 within a node takes 2, 4 or 8 ranks (parallel.ep=16)"),
    ],
)
def test_deepep_v1_layout(ep, experts, per_node, want):
    assert deepep_layout_problem(ep, experts, per_node, "v1") == want


@pytest.mark.parametrize(
    "ep, experts, per_node, v1, v2",
    [
        # sizes V1 has no config for, multiples of 8 across nodes of 8: V2 only
        (
            40,
            80,
            8,
            "DeepEP V1 (Buffer) runs EP groups of 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks "
            "only (parallel.ep=40); DeepEP V2 (ElasticBuffer, model.deepep_api=v2) takes any size",
            None,
        ),
        (56, 56, 8, "DeepEP V1 (Buffer) runs", None),
        (72, 144, 8, "DeepEP V1 (Buffer) runs", None),
        # GB200 trays of 4 GPUs, one NVLink domain: V2 only
        (8, 64, 4, "DeepEP V1 across nodes", None),
        (16, 128, 4, "DeepEP V1 across nodes", None),
        (144, 144, 8, None, None),
        (16, 128, 16, "DeepEP V1 within a node takes 2, 4 or 8 ranks", None),
        (8, 12, 8, "DeepEP splits the experts evenly", "DeepEP splits the experts evenly"),
        (
            1,
            8,
            None,
            "DeepEP needs an expert-parallel group of at least 2",
            "DeepEP needs an expert-parallel",
        ),
    ],
)
def test_deepep_v1_size_table_and_v2_rules(ep, experts, per_node, v1, v2):
    """V1 runs only the EP sizes it has configs for; V2 asks only for an even split of the experts."""
    for api, want in (("v1", v1), ("v2", v2)):
        got = deepep_layout_problem(ep, experts, per_node, api)
        assert (got is None) if want is None else got.startswith(want), (api, got)


@pytest.mark.parametrize(
    "ep, experts, per_node, chunk, want",
    [
        (4, 8, None, None, None),  # 2 experts a rank x 4 ranks = 8
        (2, 8, None, None, None),  # 4 x 2
        (8, 8, None, None, None),  # 1 x 8
        (6, 12, None, None, None),  # 2 x 6
        (16, 128, 8, None, None),  # 8 x 8: the NVLink domain is the node
        (144, 144, 72, None, None),  # 1 x 72
        (4, 8, None, 3, None),  # tokens: 3 x 4
        (
            2,
            6,
            None,
            None,
            "HybridEP needs experts-per-rank x ranks-per-node to be a multiple of 4 (3 x 2 = 6; "
            "parallel.ep=2, num_experts=6)",
        ),
        (
            5,
            10,
            None,
            None,
            "HybridEP needs experts-per-rank x ranks-per-node to be a multiple of 4 (2 x 5 = 10; "
            "parallel.ep=5, num_experts=10)",
        ),
        (
            16,
            16,
            2,
            None,
            "HybridEP needs experts-per-rank x ranks-per-node to be a multiple of 4 (1 x 2 = 2; "
            "parallel.ep=16, num_experts=16)",
        ),
        (
            8,
            12,
            None,
            None,
            "HybridEP splits the experts evenly: num_experts=12 is not a multiple of parallel.ep=8",
        ),
        (144, 144, None, None, "HybridEP's NVLink domain holds at most 72 ranks (144 here)"),
        (
            2,
            8,
            None,
            3,
            "HybridEP needs tokens-per-chunk x ranks-per-node to be a multiple of 4 (3 x 2)",
        ),
        (
            1,
            4,
            None,
            None,
            "HybridEP needs an expert-parallel group of at least 2 ranks (parallel.ep=1)",
        ),
    ],
)
def test_hybridep_layout(ep, experts, per_node, chunk, want):
    assert hybridep_layout_problem(ep, experts, per_node, chunk) == want


def test_layout_checked_at_validation_with_the_reason(adapters_built, fake_deep_ep, monkeypatch):
    """With the adapters built (test doubles) and the package present (the fake), the layout rules decide."""
    fake_deep_ep("full")
    assert validate(compose_job(["model.dispatcher=deepep", *EP2]), 2).dispatcher.name == "deepep"
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["model.dispatcher=deepep"]), 1)
    assert str(err.value) == (
        "model.dispatcher='deepep' cannot run: DeepEP needs an expert-parallel group of at "
        "least 2 ranks (parallel.ep=1); it never runs on one; use model.dispatcher=alltoall, "
        "or model.dispatcher_fallback=alltoall to fall back to it"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes of 4: the launch's node size
    job = ["model.dispatcher=deepep", "parallel.ep=8", "train.global_batch_size=8"]
    # the fake has ElasticBuffer: auto drives V2, which takes trays of 4; V1 does not
    assert validate(compose_job(job), 8).dispatcher.name == "deepep"
    with pytest.raises(
        ConfigError,
        match=r"^model.dispatcher='deepep' cannot run: DeepEP V1 across nodes takes a "
        r"multiple of 8 ranks, 8 on each node \(parallel.ep=8, 4 ranks per node\)",
    ):
        validate(compose_job([*job, "model.deepep_api=v1"]), 8)
    # node size unknown
    assert validate(compose_job(job), 8, environment=False).dispatcher.name == "deepep"
    with pytest.raises(
        ConfigError,
        match=r"HybridEP needs experts-per-rank x ranks-per-node to be a multiple of 4 "
        r"\(1 x 2 = 2; parallel.ep=2, num_experts=2\)",
    ):
        validate(compose_job(["model.dispatcher=hybridep", "model.num_experts=2", *EP2]), 2)
    plan = validate(
        compose_job(["model.dispatcher=hybridep", "model.num_experts=2", FALLBACK, *EP2]), 2
    )
    assert plan.dispatcher.name == "alltoall" and plan.notes == [
        "note: model.dispatcher=hybridep cannot run: HybridEP needs experts-per-rank x ranks-per-node to be a "
        "multiple of 4 (1 x 2 = 2; parallel.ep=2, num_experts=2); running the alltoall dispatcher instead "
        "(model.dispatcher_fallback=alltoall)"
    ]


def test_hybridep_takes_the_capacity_mode_and_fp8_padding(adapters_built, fake_deep_ep):
    """With the package (a fake) present: model.moe_capacity_factor and model.fp8_pad_experts, refused with
    ep > 1 for every other dispatcher, are modes of hybridep; deepep still refuses the capacity mode."""
    fake_deep_ep("full")
    plan = validate(
        compose_job(["model.dispatcher=hybridep", "model.moe_capacity_factor=1.25", *EP2]), 2
    )
    assert (plan.dispatcher.name, plan.model.moe.capacity_factor) == ("hybridep", 1.25)
    pad = ["model.fp8=blockwise", "model.fp8_backend=emulate", "model.fp8_pad_experts=true", *EP2]
    assert validate(compose_job(["model.dispatcher=hybridep", *pad]), 2).model.fp8.pad_experts
    with pytest.raises(ConfigError, match="with the local and hybridep dispatchers only"):
        validate(compose_job(["model.dispatcher=alltoall", *pad]), 2)
    with pytest.raises(
        ConfigError,
        match="mode of the alltoall and hybridep dispatchers but the dispatcher is 'deepep'",
    ):
        validate(
            compose_job(["model.dispatcher=deepep", "model.moe_capacity_factor=1.25", *EP2]), 2
        )


def test_hybridep_node_is_its_nvlink_domain(adapters_built, fake_deep_ep, monkeypatch):
    """HybridEP's ranks per node are the NVLink domain it reads from NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN
    (default 8), not the launch's LOCAL_WORLD_SIZE (4 GPUs per GB200 tray in a 72-GPU domain); the
    NVLINK_DOMAIN_SIZE it read before is refused, naming the new variable, with or without a fallback."""
    fake_deep_ep("full")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job_args = [
        "model.dispatcher=hybridep",
        "model.num_experts=16",
        "parallel.ep=16",
        "train.global_batch_size=16",
    ]
    job = compose_job(job_args)
    # 1 expert a rank x 8 (the default domain)
    assert validate(job, 16).dispatcher.name == "hybridep"
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "2")
    with pytest.raises(
        ConfigError, match=r"experts-per-rank x ranks-per-node to be a multiple of 4 \(1 x 2 = 2"
    ):
        validate(job, 16)
    monkeypatch.setenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "16")
    assert validate(job, 16).dispatcher.name == "hybridep"  # 1 x 16
    monkeypatch.delenv("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN")
    monkeypatch.setenv("NVLINK_DOMAIN_SIZE", "16")
    want = (
        "model.dispatcher='hybridep': NVLINK_DOMAIN_SIZE=16 is set, but HybridEP no longer reads it: export "
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=16 instead (HybridEP's EP ranks per NVLink domain), and "
        "unset NVLINK_DOMAIN_SIZE"
    )
    for fallback in ([], [FALLBACK]):
        with pytest.raises(ConfigError) as err:
            validate(compose_job([*job_args, *fallback]), 16)
        assert str(err.value) == want
    assert (
        HybridEPDispatcher.unavailable_reason(num_experts=16, check_package=False)
        == want.split(": ", 1)[1]
    )


@pytest.mark.parametrize("variant", ["nccl_mismatch", "no_cuda_toolkit"])
def test_import_time_assertion_is_reported_and_the_fallback_runs(fake_deep_ep, variant):
    """DeepEP main asserts at import time (torch's NCCL not the one it linked; no CUDA toolkit): the gate
    reports the AssertionError's words, and model.dispatcher_fallback=alltoall runs instead of a crash."""
    fake_deep_ep(variant)
    status = probe_package()
    assert status.installed and status.error.startswith("AssertionError: ") and status.classes == ()
    with pytest.raises(
        ConfigError,
        match=r"^model.dispatcher='deepep' cannot run: the deep_ep package is "
        r"installed but does not import \(AssertionError: ",
    ):
        validate(compose_job(["model.dispatcher=deepep", *EP2]), 2)
    plan = validate(compose_job(["model.dispatcher=deepep", FALLBACK, *EP2]), 2)
    assert plan.dispatcher.name == "alltoall" and "AssertionError" in plan.notes[0]


@pytest.mark.parametrize("name", ["deepep", "hybridep"])
def test_moe_preprocess_graph_is_refused_for_deepep_and_hybridep(adapters_built, name):
    """Their preprocess is not a torch plan a CUDA graph can capture (None, or DeepEP's own stream)."""
    job = [
        f"model.dispatcher={name}",
        "model.cuda_graph_scope=[moe_preprocess]",
        "parallel.dp_mode=ddp",
        *EP2,
    ]
    with pytest.raises(
        ConfigError,
        match=rf"moe_preprocess captures the torch permutation plan of the local "
        rf"and alltoall dispatchers; model.dispatcher={name} has none to capture",
    ):
        validate(compose_job(job), 2, environment=False)
    scope = ["model.cuda_graph_scope=[moe_router]", "parallel.dp_mode=ddp", *EP2]
    validate(compose_job([f"model.dispatcher={name}", *scope]), 2, environment=False)
