"""`ParallelDims`: the parallel layout of a job, validated before anything is built.

Two foldings over the same ranks (Megatron's "parallel folding"):

    attention:  world = pp x dp x cp x tp          (tp fastest)
    experts:    world = pp x edp x ep x etp        (etp fastest)

`dp` and `edp` are derived when given as -1.  The pipeline groups are the
same in both foldings.  Passed explicitly everywhere; there is no module
global.  `groups(rank)` is the pure rank arithmetic (tested without
processes); `build_meshes` makes the two torch DeviceMeshes from it.

Rank order (Megatron's "tp-cp-ep-dp-pp", tp fastest):
    attention  rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
    experts    rank = ((pp_i * edp + edp_i) * ep + ep_i) * etp + etp_i
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moevlm.model.config import ConfigError, VLMConfig


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

    def __post_init__(self):
        _check(self.world >= 1, f"world size {self.world} must be >= 1")
        for name in ("tp", "cp", "pp", "ep", "etp"):
            _check(getattr(self, name) >= 1, f"parallel.{name}={getattr(self, name)} must be >= 1")
        _check(
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

    @staticmethod
    def _derive(name: str, value: int, per_stage: int, inner: int, what: str) -> int:
        if value == -1:
            _check(
                per_stage % inner == 0,
                f"world/pp = {per_stage} ranks per pipeline stage is not divisible by {what} = {inner}; "
                f"change parallel.{what.replace('*', ' or parallel.')} or the number of processes",
            )
            return per_stage // inner
        _check(value >= 1, f"parallel.{name}={value} must be >= 1 or -1 (derived)")
        _check(
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

    def groups(self, rank: int) -> dict[str, list[int]]:
        """The ranks that differ from `rank` only along one dimension, per dimension,
        plus `dp_cp` (where dense parameters are sharded), in rank order."""
        mine = self.coords(rank)
        out = {}
        for dims in (("tp",), ("cp",), ("dp",), ("pp",), ("etp",), ("ep",), ("edp",), ("dp", "cp")):
            names = self.EXPERT if dims[0] in self.EXPERT[1:] else self.ATTN
            members = [rank]
            for d in dims:
                stride = math.prod(self.shape(names[names.index(d) + 1 :]))
                members = [
                    m + (k - mine[d]) * stride for m in members for k in range(getattr(self, d))
                ]
            out["_".join(dims)] = sorted(members)
        return out

    def describe_ranks(self) -> str:
        """One line per rank: its group along every dimension."""
        lines = [self.describe()]
        for r in range(self.world):
            g = self.groups(r)
            lines.append(
                f"rank {r}: "
                + "  ".join(f"{k} {v}" for k, v in g.items() if len(v) > 1 or k == "dp")
            )
        return "\n".join(lines)

    def build_meshes(self, device_type: str):
        """(attention mesh (pp, dp, cp, tp), expert mesh (pp, edp, ep, etp)) over the same ranks.
        Collective: every rank calls it, after init_process_group."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(self.world)
        return (
            DeviceMesh(device_type, ranks.reshape(self.shape(self.ATTN)), mesh_dim_names=self.ATTN),
            DeviceMesh(
                device_type, ranks.reshape(self.shape(self.EXPERT)), mesh_dim_names=self.EXPERT
            ),
        )

    def check_model(self, cfg: VLMConfig) -> None:
        """Divisibility of the model by the layout, with what to change."""
        t, m = cfg.text, cfg.moe
        _check(
            t.num_heads % self.tp == 0,
            f"text.num_heads={t.num_heads} is not divisible by parallel.tp={self.tp}",
        )
        _check(
            t.num_kv_heads % self.tp == 0 or self.tp % t.num_kv_heads == 0,
            f"text.num_kv_heads={t.num_kv_heads} and parallel.tp={self.tp}: one must divide the other",
        )
        _check(
            t.vocab_size % self.tp == 0,
            f"text.vocab_size={t.vocab_size} is not divisible by parallel.tp={self.tp} (the embedding and LM head "
            "are split along the vocabulary); pad the vocabulary or change parallel.tp",
        )
        _check(t.num_layers >= self.pp, f"text.num_layers={t.num_layers} < parallel.pp={self.pp}")
        if m.num_experts:
            _check(
                m.num_experts % self.ep == 0,
                f"moe.num_experts={m.num_experts} is not divisible by parallel.ep={self.ep}",
            )
            _check(
                m.moe_intermediate_size % self.etp == 0,
                f"moe.moe_intermediate_size={m.moe_intermediate_size} is not divisible by parallel.etp={self.etp}",
            )
        elif self.ep > 1 or self.etp > 1:
            raise ConfigError("parallel.ep/etp > 1 need a MoE model (moe.num_experts > 0)")

    def describe(self) -> str:
        return (
            f"world {self.world} = pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp} "
            f"= pp {self.pp} x edp {self.edp} x ep {self.ep} x etp {self.etp}"
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
