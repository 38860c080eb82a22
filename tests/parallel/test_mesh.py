"""ParallelDims: the rank arithmetic by hand (no processes), every invalid layout's message, and the two
DeviceMeshes built by torch over gloo agreeing with the arithmetic (one launch)."""

import pytest
import torch.distributed as dist
from gloo_ranks import run_ranks

from moevlm.dispatch import DispatcherSpec
from moevlm.errors import ConfigError
from moevlm.model import VLMConfig
from moevlm.parallel import ParallelDims
from moevlm.parallel.build import BuildOptions


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


def test_hsdp_groups_by_hand_world16():
    """dp_replicate 2: the replicas are the outer half of dp (and of edp), the shard groups blocks of
    consecutive ranks (dense: strided by tp; vision: the whole block; experts: strided by ep x etp)."""
    d = ParallelDims(16, tp=2, cp=2, ep=2, dp_replicate=2)
    assert (d.dp, d.dp_shard, d.edp, d.edp_shard) == (4, 2, 8, 4)
    g = d.groups(5)  # attention: dp 1 (replica 0, shard 1), cp 0, tp 1; experts: edp 2, ep 1
    assert g["dp"] == [1, 5, 9, 13] and g["dp_cp"] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert g["dense_replicate"] == [5, 13] and g["dense_shard"] == [1, 3, 5, 7]
    assert g["vision_replicate"] == [5, 13] and g["vision_shard"] == list(range(8))
    assert g["expert_replicate"] == [5, 13] and g["expert_shard"] == [1, 3, 5, 7]
    g = d.groups(10)  # dp 2 (replica 1, shard 0), cp 1, tp 0; edp 5 (replica 1, shard 1), ep 0
    assert g["dense_replicate"] == [2, 10] and g["dense_shard"] == [8, 10, 12, 14]
    assert g["vision_shard"] == list(range(8, 16)) and g["expert_shard"] == [8, 10, 12, 14]


def test_hsdp_expert_fold_differs_from_dense():
    """world 8, ep 4: dense (replicate 2 x shard 4) but experts edp 2 = (replicate 2 x shard 1)."""
    d = ParallelDims(8, ep=4, dp_replicate=2)
    g = d.groups(6)
    assert g["dense_replicate"] == [2, 6] and g["dense_shard"] == [4, 5, 6, 7]
    assert g["expert_replicate"] == [2, 6] and g["expert_shard"] == [6] and g["ep"] == [4, 5, 6, 7]
    assert (
        "replicate 2 x shard 4" in d.describe() and "edp 2 (replicate 2 x shard 1)" in d.describe()
    )


def test_without_replicas_the_shard_groups_are_fsdp_groups():
    d = ParallelDims(16, tp=2, cp=2, ep=2)
    for r in range(16):
        g = d.groups(r)
        assert g["dense_shard"] == g["dp_cp"] and g["expert_shard"] == g["edp"]
        assert g["vision_shard"] == list(range(16))
        assert g["dense_replicate"] == g["vision_replicate"] == g["expert_replicate"] == [r]
    assert "replicate" not in d.describe_ranks()


@pytest.mark.parametrize(
    "world, kw",
    [
        (16, dict(tp=2, cp=2, ep=2, dp_replicate=2)),
        (16, dict(ep=4, dp_replicate=4)),
        (16, dict(pp=2, tp=2, ep=2, dp_replicate=2)),
        (8, dict(cp=2, dp_replicate=4)),
    ],
)
def test_hsdp_groups_partition_the_ranks_and_multiply_to_fsdp(world, kw):
    """Every folded group kind partitions the ranks; replicate x shard is the FSDP group."""
    d = ParallelDims(world, **kw)
    whole = {"dense": "dp_cp", "expert": "edp"}
    for kind, (rep, shard) in d.FOLDED.items():
        for name, size in ((rep, d.dp_replicate), (shard, None)):
            seen = {tuple(d.groups(r)[name]) for r in range(world)}
            assert sorted(x for grp in seen for x in grp) == list(range(world)), name
            assert size is None or all(len(grp) == size for grp in seen), name
        for r in range(world):
            g = d.groups(r)
            # replica x shard: the ranks FSDP would shard over without replicas
            span = sorted(x for y in g[rep] for x in d.groups(y)[shard])
            want = (
                g[whole[kind]]
                if kind in whole
                else sorted(x for y in g["dp_cp"] for x in d.groups(y)["tp"])
            )
            assert span == want, (kind, r)
            # the replicas are the outer ranks: every member of my replicate group lies in another
            # (consecutive) shard block
            assert len({x // (world // d.pp // d.dp_replicate) for x in g[rep]}) == d.dp_replicate


@pytest.mark.parametrize(
    "world, overrides, words",
    [
        (4, ["parallel.dp_replicate=3"], "parallel.dp_replicate=3 does not divide parallel.dp=4"),
        (
            4,
            ["parallel.dp_replicate=4", "parallel.ep=2", "model.dispatcher=alltoall"],
            "parallel.dp_replicate=4 does not divide the experts' data-parallel size edp=2",
        ),
        (
            4,
            ["parallel.dp_replicate=2", "parallel.dp_mode=ddp"],
            "parallel.dp_replicate=2 needs parallel.dp_mode=fsdp: ddp already replicates every weight",
        ),
    ],
)
def test_hsdp_refusals_are_one_config_error_line(world, overrides, words):
    """validate() (what train.py prints as `config error:` lines) refuses each with one line that names
    what to change."""
    from moevlm.config import compose_job, validate

    base = ["train.global_batch_size=4"]  # a multiple of dp = 4
    with pytest.raises(ConfigError) as err:
        validate(compose_job(base + overrides), world_size=world, environment=False)
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert "choose a divisor" in lines[0] or "use dp_mode=fsdp" in lines[0]
    # the same layout with dp_replicate 1 (or a divisor) is valid
    fixed = [o for o in overrides if not o.startswith("parallel.dp_replicate")]
    validate(
        compose_job(base + fixed + ["parallel.dp_replicate=1"]), world_size=world, environment=False
    )
    validate(compose_job(base + ["parallel.dp_replicate=2"]), world_size=world, environment=False)


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
        (8, dict(dp_replicate=3), r"parallel.dp_replicate=3 does not divide parallel.dp=8"),
        (
            8,
            dict(ep=4, dp_replicate=4),
            r"parallel.dp_replicate=4 does not divide the experts' data-parallel "
            r"size edp=2 .*choose a divisor of 2",
        ),
        (8, dict(dp_replicate=0), "parallel.dp_replicate=0 must be >= 1"),
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

    with pytest.raises(ValueError, match="parallel.pp=2 needs its PipelineSplit"):
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
    from moevlm.parallel.data_parallel import _copies

    for kw in (
        dict(tp=2, ep=2),
        dict(cp=2, ep=4, etp=1),
        dict(pp=2, ep=2),
        dict(dp_replicate=2, ep=2),
        dict(dp_replicate=2, cp=2),
    ):
        d = ParallelDims(world, **kw)
        attn, experts = d.build_meshes("cpu")
        want = d.groups(rank)

        def ranks(mesh, dim=None):
            return sorted(dist.get_process_group_ranks(mesh.get_group(dim)))

        for mesh, names in ((attn, d.ATTN), (experts, d.EXPERT)):
            for name in names:
                if name not in mesh.mesh_dim_names:  # dp, edp under HSDP: flattened, below
                    continue
                assert ranks(mesh, name) == want[name], (kw, name)
        data = d.data_meshes(attn, experts)
        for name in ("dp", "edp", "dp_cp", "dp_cp_tp"):
            assert data[name].ndim == 1
            expect = want[name] if name in want else list(range(world // d.pp))
            if name == "dp_cp_tp" and d.pp > 1:
                expect = sorted(x for y in want["dp_cp"] for x in d.groups(y)["tp"])
            assert ranks(data[name]) == expect, (kw, name)
        for kind, (rep, shard) in d.FOLDED.items():
            mesh = data[kind]
            if d.dp_replicate == 1:  # plain FSDP: 1-D, the whole group
                assert mesh.ndim == 1 and ranks(mesh) == want[shard], (kw, kind)
            else:  # HSDP: (replicate, shard)
                assert mesh.ndim == 2, (kw, kind)
                assert ranks(mesh, 0) == want[rep] and ranks(mesh, 1) == want[shard], (kw, kind)
    # a model under HSDP: FSDP2 places (Replicate, Shard) and the clip counts each shard once
    from torch.distributed.tensor import Replicate, Shard

    from moevlm.parallel import build_model

    d = ParallelDims(world, dp_replicate=2, ep=2)
    model, ctx = build_model(
        TINY, d, BuildOptions(dp_mode="fsdp", dispatcher=DispatcherSpec("alltoall"))
    )
    params = dict(model.named_parameters())
    dense = params["text.layers.0.self_attn.q_proj.weight"]
    assert tuple(dense.placements) == (Replicate(), Shard(0)), dense.placements
    assert dense.device_mesh.shape == (2, 2) and _copies(dense, world) == 2
    vision = next(p for n, p in params.items() if n.startswith("vision."))
    assert tuple(vision.placements) == (Replicate(), Shard(0)) and _copies(vision, world) == 2
    expert = next(p for n, p in params.items() if n.endswith("experts.gate_up_proj"))
    # (edp replicate, edp shard, ep, etp): each expert shard on the 2 replicas
    assert isinstance(expert.placements[0], Replicate) and expert.device_mesh.ndim == 4
    assert expert.device_mesh.shape == (2, 1, 2, 1) and _copies(expert, world) == 2
    assert (
        sorted(dist.get_process_group_ranks(ctx.groups["dense_replicate"]))
        == d.groups(rank)["dense_replicate"]
    )


@pytest.mark.slow
def test_device_meshes_match_the_arithmetic(tmp_path):
    """torch's meshes and process groups equal ParallelDims.groups, with and without replicas; under HSDP
    FSDP2 shards with (Replicate, Shard) on the 2-D meshes."""
    run_ranks(_mesh_checks, 4, tmp_path, 4)
