"""ParallelDims: the rank arithmetic by hand (no processes), every invalid layout's message, and the two
DeviceMeshes built by torch over gloo agreeing with the arithmetic (one launch)."""

import pytest
import torch.distributed as dist
from gloo_ranks import run_ranks

from moevlm.model import VLMConfig
from moevlm.model.config import ConfigError
from moevlm.parallel import ParallelDims


def test_groups_by_hand_world8_tp2_pp2_ep2():
    d = ParallelDims(8, tp=2, pp=2, ep=2)
    assert (d.dp, d.edp) == (2, 2)
    # attention (pp, dp, cp, tp) = (2, 2, 1, 2); experts (pp, edp, ep, etp) = (2, 2, 2, 1)
    g = d.groups(5)  # pp 1, dp 0, tp 1 | pp 1, edp 0, ep 1
    assert d.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1, "edp": 0, "ep": 1, "etp": 0}
    assert g["tp"] == [4, 5] and g["dp"] == [5, 7] and g["pp"] == [1, 5] and g["cp"] == [5]
    assert g["ep"] == [4, 5] and g["edp"] == [5, 7] and g["etp"] == [5] and g["dp_cp"] == [5, 7]


def test_groups_by_hand_world16_folded():
    d = ParallelDims(16, tp=2, cp=2, ep=4, etp=2)
    assert (d.dp, d.edp) == (4, 2)
    g = d.groups(6)  # attention: dp 1, cp 1, tp 0; experts: edp 0, ep 3, etp 0
    assert g["tp"] == [6, 7] and g["cp"] == [4, 6] and g["dp"] == [2, 6, 10, 14]
    assert g["dp_cp"] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert g["etp"] == [6, 7] and g["ep"] == [0, 2, 4, 6] and g["edp"] == [6, 14]


@pytest.mark.parametrize(
    "world, kw",
    [
        (8, dict(tp=2, pp=2, ep=2)),
        (16, dict(tp=2, cp=2, ep=4, etp=2)),
        (12, dict(tp=3, ep=2, etp=2)),
    ],
)
def test_groups_partition_the_ranks(world, kw):
    d = ParallelDims(world, **kw)
    for dim in ("tp", "cp", "dp", "pp", "etp", "ep", "edp", "dp_cp"):
        seen = {tuple(d.groups(r)[dim]) for r in range(world)}
        # disjoint and complete
        assert sorted(r for grp in seen for r in grp) == list(range(world)), dim
        size = {"dp_cp": d.dp * d.cp}.get(dim) or getattr(d, dim)
        assert all(len(grp) == size for grp in seen)


TINY = VLMConfig.preset("tiny")  # 4 heads, 2 kv heads, vision 2 heads, 3 layers, 8 experts, F 48


@pytest.mark.parametrize(
    "world, kw, message",
    [
        (0, {}, "world size 0 must be >= 1"),
        (8, dict(pp=3), "world size 8 is not divisible by parallel.pp=3"),
        (8, dict(tp=3), r"not divisible by tp\*cp = 3"),
        (8, dict(ep=3), r"not divisible by ep\*etp = 3"),
        (8, dict(tp=2, dp=2), r"parallel.dp=2 x tp\*cp=2 = 4 but world/pp = 8"),
        (8, dict(ep=2, edp=2), r"parallel.edp=2 x ep\*etp=2 = 4 but world/pp = 8"),
        (8, dict(tp=-1), "parallel.tp=-1 must be >= 1"),
    ],
)
def test_invalid_layouts(world, kw, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims(world, **kw)


@pytest.mark.parametrize(
    "world, kw, message",
    [
        (8, dict(tp=8), "text.num_heads=4 is not divisible by parallel.tp=8"),
        (6, dict(tp=3, ep=2), "text.num_heads=4 is not divisible by parallel.tp=3"),
        (16, dict(pp=4, ep=4), "text.num_layers=3 < parallel.pp=4"),
        (6, dict(ep=3, etp=2), "moe.num_experts=8 is not divisible by parallel.ep=3"),
        (10, dict(ep=2, etp=5), "moe.moe_intermediate_size=48 is not divisible by parallel.etp=5"),
    ],
)
def test_layouts_the_model_cannot_take(world, kw, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims(world, **kw).check_model(TINY)


def test_vocabulary_must_split_over_tp():
    cfg = VLMConfig.preset("tiny")
    cfg.text.vocab_size = 1001
    with pytest.raises(ConfigError, match="text.vocab_size=1001 is not divisible by parallel.tp=2"):
        ParallelDims(2, tp=2).check_model(cfg)


def test_pipeline_stages_need_their_plan():
    from moevlm.parallel import build_model

    with pytest.raises(ValueError, match="parallel.pp=2 needs its PipelinePlan"):
        build_model(TINY, ParallelDims(4, ep=2, pp=2))


def test_kv_heads_fewer_than_tp_replicate_but_must_divide():
    cfg = VLMConfig.preset("tiny")
    cfg.text.num_heads, cfg.text.num_kv_heads, cfg.vision.num_heads = 12, 4, 4
    ParallelDims(4, tp=4).check_model(cfg)  # 4 kv heads, one per rank
    with pytest.raises(ConfigError, match="text.num_kv_heads=4 and parallel.tp=6"):
        ParallelDims(6, tp=6).check_model(cfg)
    cfg2 = VLMConfig.preset("tiny")
    cfg2.moe.num_experts = 0
    with pytest.raises(ConfigError, match="need a MoE model"):
        ParallelDims(2, ep=2).check_model(cfg2)


# ----------------------------------------------------------------- one gloo launch
def _mesh_checks(rank: int, world: int) -> None:
    for kw in (dict(tp=2, ep=2), dict(cp=2, ep=4, etp=1), dict(pp=2, ep=2)):
        d = ParallelDims(world, **kw)
        attn, experts = d.build_meshes("cpu")
        want = d.groups(rank)
        for mesh, names in ((attn, d.ATTN), (experts, d.EXPERT)):
            for name in names:
                got = sorted(dist.get_process_group_ranks(mesh.get_group(name)))
                assert got == want[name], (kw, name, got, want[name])


def test_device_meshes_match_the_arithmetic(tmp_path):
    run_ranks(_mesh_checks, 4, tmp_path, 4)
