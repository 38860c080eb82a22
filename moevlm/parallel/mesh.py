"""`ParallelDims`: the parallel layout of a job, validated before anything is built, and its meshes.

Two foldings over the same ranks, tp / etp fastest (Megatron's "tp-cp-ep-dp-pp"):

    attention  world = pp x dp x cp x tp     rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
    experts    world = pp x edp x ep x etp   rank = ((pp_i * edp + edp_i) * ep + ep_i) * etp + etp_i

`dp` and `edp` are derived when -1.  HSDP (`dp_replicate` = R > 1) splits dp_i = rep_i * (dp/R) +
shard_i and edp alike, the replica index outer: FSDP2 meshes (R, dp/R x cp), (R, dp/R x cp x tp) and
(R, edp/R).  `groups(rank)` is the pure rank arithmetic; `build_meshes` makes the two DeviceMeshes
and `data_meshes` the data-parallel ones.  Why: docs/architecture.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moevlm.errors import ConfigError, check
from moevlm.model.config import VLMConfig


@dataclass(frozen=True)
class ParallelDims:
    world: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = -1
    ep: int = 1
    etp: int = 1
    edp: int = -1
    dp_replicate: int = 1  # HSDP replicas (module docstring); 1 = FSDP over every data rank

    def __post_init__(self):
        check(self.world >= 1, f"world size {self.world} must be >= 1")
        for name in ("tp", "cp", "pp", "ep", "etp"):
            check(getattr(self, name) >= 1, f"parallel.{name}={getattr(self, name)} must be >= 1")
        check(
            self.world % self.pp == 0,
            f"world size {self.world} is not divisible by parallel.pp={self.pp}",
        )
        per_stage = self.world // self.pp
        object.__setattr__(
            self, "dp", self._derive("dp", self.dp, per_stage, self.tp * self.cp, "tp*cp")
        )
        object.__setattr__(
            self, "edp", self._derive("edp", self.edp, per_stage, self.ep * self.etp, "ep*etp")
        )
        r = self.dp_replicate
        check(r >= 1, f"parallel.dp_replicate={r} must be >= 1 (1 = FSDP without replicas)")
        check(
            self.dp % r == 0,
            f"parallel.dp_replicate={r} does not divide parallel.dp={self.dp} (the replicas are taken out "
            f"of the data-parallel ranks); choose a divisor of {self.dp}",
        )
        check(
            self.edp % r == 0,
            f"parallel.dp_replicate={r} does not divide the experts' data-parallel size edp={self.edp} "
            f"(world/pp / (ep x etp)); choose a divisor of {math.gcd(self.dp, self.edp)} or change "
            "parallel.ep / parallel.etp",
        )

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks in one HSDP shard group (dp without replicas: dp)."""
        return self.dp // self.dp_replicate

    @property
    def edp_shard(self) -> int:
        return self.edp // self.dp_replicate

    @staticmethod
    def _derive(name: str, value: int, per_stage: int, inner: int, what: str) -> int:
        if value == -1:
            check(
                per_stage % inner == 0,
                f"world/pp = {per_stage} ranks per pipeline stage is not divisible by {what} = {inner}; "
                f"change parallel.{what.replace('*', ' or parallel.')} or the number of processes",
            )
            return per_stage // inner
        check(value >= 1, f"parallel.{name}={value} must be >= 1 or -1 (derived)")
        check(
            value * inner == per_stage,
            f"parallel.{name}={value} x {what}={inner} = {value * inner} but world/pp = {per_stage}; "
            f"set parallel.{name}=-1 to derive it",
        )
        return value

    # ------------------------------------------------------------- rank groups
    ATTN = ("pp", "dp", "cp", "tp")
    EXPERT = ("pp", "edp", "ep", "etp")

    def shape(self, names: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in names)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension of both foldings."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside 0..{self.world - 1}")
        out: dict[str, int] = {}
        for names in (self.ATTN, self.EXPERT):
            rest = rank
            for name, size in reversed(list(zip(names, self.shape(names)))):
                rest, out[name] = divmod(rest, size)
        return out

    # the HSDP dimensions (module docstring), outer first; the rest of each folding as above
    ATTN_HSDP = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    EXPERT_HSDP = ("pp", "edp_replicate", "edp_shard", "ep", "etp")
    # groups() names of the HSDP groups: (replicate, shard) per FSDP mesh
    FOLDED = {
        "dense": ("dense_replicate", "dense_shard"),
        "vision": ("vision_replicate", "vision_shard"),
        "expert": ("expert_replicate", "expert_shard"),
    }

    def groups(self, rank: int) -> dict[str, list[int]]:
        """The ranks that differ from `rank` only along one dimension, per dimension,
        plus `dp_cp` (where dense parameters are sharded) and the HSDP groups (`FOLDED`: with
        R = 1 each replicate group is the rank alone and each shard group the whole FSDP group),
        in rank order."""
        mine = self.coords(rank)
        r = self.dp_replicate
        mine.update(
            dp_replicate=mine["dp"] // self.dp_shard,
            dp_shard=mine["dp"] % self.dp_shard,
            edp_replicate=mine["edp"] // self.edp_shard,
            edp_shard=mine["edp"] % self.edp_shard,
        )
        sizes = {
            "dp_replicate": r,
            "dp_shard": self.dp_shard,
            "edp_replicate": r,
            "edp_shard": self.edp_shard,
        }
        shape = {**{n: getattr(self, n) for n in self.ATTN + self.EXPERT}, **sizes}
        out = {}
        for key, dims in (
            ("tp", ("tp",)),
            ("cp", ("cp",)),
            ("dp", ("dp",)),
            ("pp", ("pp",)),
            ("etp", ("etp",)),
            ("ep", ("ep",)),
            ("edp", ("edp",)),
            ("dp_cp", ("dp", "cp")),
            ("dense_replicate", ("dp_replicate",)),
            ("dense_shard", ("dp_shard", "cp")),
            ("vision_replicate", ("dp_replicate",)),
            ("vision_shard", ("dp_shard", "cp", "tp")),
            ("expert_replicate", ("edp_replicate",)),
            ("expert_shard", ("edp_shard",)),
        ):
            names = next(
                n
                for n in (self.ATTN, self.EXPERT, self.ATTN_HSDP, self.EXPERT_HSDP)
                if dims[0] in n
            )
            members = [rank]
            for d in dims:
                stride = math.prod(shape[n] for n in names[names.index(d) + 1 :])
                members = [m + (k - mine[d]) * stride for m in members for k in range(shape[d])]
            out[key] = sorted(members)
        return out

    def describe_ranks(self) -> str:
        """One line per rank: its group along every dimension."""
        lines = [self.describe()]
        for r in range(self.world):
            g = self.groups(r)
            lines.append(
                f"rank {r}: "
                + "  ".join(
                    f"{k} {v}"
                    for k, v in g.items()
                    if (len(v) > 1 or k == "dp")
                    and (self.dp_replicate > 1 or k.split("_")[-1] not in ("replicate", "shard"))
                )
            )
        return "\n".join(lines)

    def build_meshes(self, device_type: str):
        """(attention mesh (pp, dp, cp, tp), expert mesh (pp, edp, ep, etp)) over the same ranks.
        With dp_replicate > 1 the meshes are (pp, dp_replicate, dp_shard, cp, tp) and
        (pp, edp_replicate, edp_shard, ep, etp), with `dp` and `edp` flattened from their data
        dimensions (module docstring).  Collective: every rank calls it, after init_process_group."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world)
        if self.dp_replicate == 1:
            return (
                DeviceMesh(
                    device_type, ranks.reshape(self.shape(self.ATTN)), mesh_dim_names=self.ATTN
                ),
                DeviceMesh(
                    device_type, ranks.reshape(self.shape(self.EXPERT)), mesh_dim_names=self.EXPERT
                ),
            )
        r = self.dp_replicate
        return (
            DeviceMesh(
                device_type,
                ranks.reshape(self.pp, r, self.dp_shard, self.cp, self.tp),
                mesh_dim_names=self.ATTN_HSDP,
            ),
            DeviceMesh(
                device_type,
                ranks.reshape(self.pp, r, self.edp_shard, self.ep, self.etp),
                mesh_dim_names=self.EXPERT_HSDP,
            ),
        )

    def data_meshes(self, attn, expert) -> dict:
        """The data-parallel meshes, from `build_meshes`' two.  1-D: `dp`, `edp`, `dp_cp` (dense) and
        `dp_cp_tp` (vision).  FSDP2's: `dense`, `vision`, `expert`: the 1-D dp_cp, dp_cp_tp and edp,
        or with dp_replicate > 1 each 2-D (replicate, shard), which makes `fully_shard` HSDP.
        Flattened meshes are kept as `_flatten` returns them (slicing a flattened name from the root
        is deprecated in torch); a 2-D mesh of a root dimension and a flattened one is
        `DeviceMesh._concatenate` where torch has it, else the root sliced by both names.
        Collective (flattening makes process groups)."""
        if self.dp_replicate == 1:
            out = {
                "dp": attn["dp"],
                "edp": expert["edp"],
                "dp_cp": attn["dp", "cp"]._flatten("dp_cp"),
                "dp_cp_tp": attn["dp", "cp", "tp"]._flatten("dp_cp_tp"),
            }
            return out | {"dense": out["dp_cp"], "vision": out["dp_cp_tp"], "expert": out["edp"]}
        from torch.distributed.device_mesh import DeviceMesh

        data = ("dp_replicate", "dp_shard", "cp")
        out = {
            "dp": attn["dp_replicate", "dp_shard"]._flatten("dp"),
            "edp": expert["edp_replicate", "edp_shard"]._flatten("edp"),
            "dp_cp": attn[data]._flatten("dp_cp"),
            "dp_cp_tp": attn[(*data, "tp")]._flatten("dp_cp_tp"),
            "expert": expert["edp_replicate", "edp_shard"],
        }
        shard = attn["dp_shard", "cp"]._flatten("dp_shard_cp")
        shard_tp = attn["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
        if hasattr(DeviceMesh, "_concatenate"):
            out["dense"] = DeviceMesh._concatenate([attn["dp_replicate"], shard])
            out["vision"] = DeviceMesh._concatenate([attn["dp_replicate"], shard_tp])
        else:  # pragma: no cover - torch without _concatenate
            out["dense"] = attn["dp_replicate", "dp_shard_cp"]
            out["vision"] = attn["dp_replicate", "dp_shard_cp_tp"]
        return out

    def check_model(self, cfg: VLMConfig) -> None:
        """Divisibility of the model by the layout, with what to change."""
        t, m = cfg.text, cfg.moe
        check(
            t.num_heads % self.tp == 0,
            f"text.num_heads={t.num_heads} is not divisible by parallel.tp={self.tp}",
        )
        check(
            t.num_kv_heads % self.tp == 0 or self.tp % t.num_kv_heads == 0,
            f"text.num_kv_heads={t.num_kv_heads} and parallel.tp={self.tp}: one must divide the other",
        )
        check(
            t.vocab_size % self.tp == 0,
            f"text.vocab_size={t.vocab_size} is not divisible by parallel.tp={self.tp} (the embedding and LM head "
            "are split along the vocabulary); pad the vocabulary or change parallel.tp",
        )
        check(t.num_layers >= self.pp, f"text.num_layers={t.num_layers} < parallel.pp={self.pp}")
        gdn = "linear_attention" in t.layer_types
        check(
            not gdn or t.linear_num_key_heads % self.tp == 0,
            f"text.linear_num_key_heads={t.linear_num_key_heads} is not divisible by parallel.tp={self.tp} "
            "(the Gated DeltaNet layers split their key heads, each with its value heads, over tp)",
        )
        check(
            not gdn or t.linear_num_key_heads % self.cp == 0,
            f"text.linear_num_key_heads={t.linear_num_key_heads} is not divisible by parallel.cp={self.cp} "
            "(the Gated DeltaNet layers split their key heads, each with its value heads, over cp)",
        )
        check(
            not gdn or t.linear_num_key_heads % (self.cp * self.tp) == 0,
            f"text.linear_num_key_heads={t.linear_num_key_heads} is not divisible by parallel.cp x tp="
            f"{self.cp * self.tp} (the Gated DeltaNet layers split each tp rank's key heads over cp)",
        )
        if m.num_experts:
            check(
                m.num_experts % self.ep == 0,
                f"moe.num_experts={m.num_experts} is not divisible by parallel.ep={self.ep}",
            )
            check(
                m.moe_intermediate_size % self.etp == 0,
                f"moe.moe_intermediate_size={m.moe_intermediate_size} is not divisible by parallel.etp={self.etp}",
            )
        elif self.ep > 1 or self.etp > 1:
            raise ConfigError("parallel.ep/etp > 1 need a MoE model (moe.num_experts > 0)")

    def describe(self) -> str:
        if self.dp_replicate == 1:
            dp, edp = f"dp {self.dp}", f"edp {self.edp}"
        else:
            r = self.dp_replicate
            dp = f"dp {self.dp} (replicate {r} x shard {self.dp_shard})"
            edp = f"edp {self.edp} (replicate {r} x shard {self.edp_shard})"
        return (
            f"world {self.world} = pp {self.pp} x {dp} x cp {self.cp} x tp {self.tp} "
            f"= pp {self.pp} x {edp} x ep {self.ep} x etp {self.etp}"
        )
