"""Gated DeltaNet: Qwen3.5's linear-attention layer, over packed rows of documents.

Legend: B batch, S sequence, T tokens (B*S flattened), D hidden, C conv channels, H value heads,
Hk key heads, Kd key head dim, Vd value head dim, N chunks, L chunk length.

    gdn = GatedDeltaNet(D, Hk, H, Kd, Vd, conv_kernel=4)    # transformers' parameter names and shapes
    y_BSD = gdn(x_BSD, cu_seqlens)                           # state and conv window reset per document
    o_THV = chunk_gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, bounds)  # fp32 inside

in_proj_qkv's rows and the conv's channels are grouped by key head (`qkv_order`: q_j, k_j, then the
v of j's value heads). Split over n ranks (`share` = (i, n); tensor and/or context parallelism,
`sequence` their strategy) the layer reads the whole sequence and computes key heads
[i Hk/n, (i+1) Hk/n) with their value heads: a contiguous 1/n of every parameter but the norm's
(slices of the whole, or of a tensor-parallel shard); the output is summed over the n ranks.

Backends (`backend`): `torch` (the chunked delta rule here; CPU, tests), `fla` (the optional package
flash-linear-attention's chunked kernel, imported lazily; CUDA, bf16/fp16), `auto` (`fla` where it
imports and fits, else `torch`) and `modelled` (fla's kernel as a plan models it:
`moevlm.model.gdn_modelled`).  The causal conv is ours on all.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moevlm.model.attention import static_bounds
from moevlm.model.linear import Linear
from moevlm.model.region import run_region
from moevlm.model.strategies import Sequence, local

GDN_BACKENDS = ("auto", "torch", "fla", "modelled")
FLA_DTYPES = (torch.bfloat16, torch.float16)  # its kernel refuses fp32


class GatedDeltaNet(nn.Module):
    """in_proj_qkv → causal depthwise conv (SiLU) → per-head decay g and write strength beta →
    gated delta rule → RMSNorm gated by silu(in_proj_z) → out_proj."""

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        chunk_size: int = 64,
        backend: str = "auto",
        sequence: Sequence | None = None,
        share: tuple[int, int] = (0, 1),
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={num_v_heads} must be a multiple of "
                f"linear_num_key_heads={num_k_heads} (each key head serves whole value heads)"
            )
        if backend not in GDN_BACKENDS:
            raise ValueError(f"gdn backend={backend!r}; choose one of {list(GDN_BACKENDS)}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.chunk_size, self.backend = chunk_size, backend
        self.seq, self.share = sequence or Sequence(), share
        if num_k_heads % share[1]:
            raise ValueError(
                f"linear_num_key_heads={num_k_heads} is not divisible by {share[1]} ranks"
            )
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, value_dim, bias=False)
        self.in_proj_b = Linear(hidden, num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, num_v_heads, bias=False)
        # a container for the weight (C, 1, K) under its checkpoint name; the forward is conv_by_doc
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False, padding=conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(value_dim, hidden, bias=False)

    def forward(self, x_BsD: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x as the layers see it (this rank's share of the sequence under sequence parallelism)."""
        return run_region(self, "region", self._forward, x_BsD, cu_seqlens)

    def _forward(self, x_BsD: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        x_BSD = self.seq.gather_whole(x_BsD)
        B, S, _ = x_BSD.shape
        hk, h = self.num_k_heads // self.share[1], self.num_v_heads // self.share[1]  # this rank's
        bounds = static_bounds(B, S, cu_seqlens, x_BSD.device)
        pos_BS = position_in_document(bounds, B, S)
        qk_dim, v_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        whole = 2 * qk_dim + v_dim
        w_qkv = self._mine(self.in_proj_qkv.weight, whole)
        w_conv = self._mine(self.conv1d.weight, whole)[:, 0]
        qkv_BSC = conv_by_doc(self.in_proj_qkv.project(x_BSD, w_qkv), w_conv, pos_BS)
        q, k, v = (
            F.silu(qkv_BSC)
            .reshape(B * S, hk, -1)
            .split([self.head_k_dim, self.head_k_dim, h // hk * self.head_v_dim], -1)
        )
        H = self.num_v_heads
        beta_TH = self._project(self.in_proj_b, x_BSD, H).reshape(B * S, h).sigmoid()
        a_TH = self._project(self.in_proj_a, x_BSD, H).reshape(B * S, h)
        A_log, dt_bias = self._mine(self.A_log, H), self._mine(self.dt_bias, H)
        g_TH = -A_log.float().exp() * F.softplus(a_TH.float() + dt_bias)
        o_THV = run_region(
            self,
            "core_region",  # the chunked delta rule: recompute's core_attn wraps it here
            gated_delta_rule,
            q,
            k,
            v,
            g_TH,
            beta_TH,
            bounds,
            self.chunk_size,
            self.backend,
            # rows alone: exactly ceil(S/L) chunks each, no spare chunk per document
            B * -(-S // self.chunk_size) if cu_seqlens is None else None,
        )
        z_THV = self._project(self.in_proj_z, x_BSD, v_dim).reshape(B * S, h, -1)
        o_BSV = self.norm(o_THV, z_THV).reshape(B, S, -1)
        w_out = self._mine(self.out_proj.weight, v_dim, dim=1)
        return self.seq.scatter_sum(self.out_proj.project(o_BSV, w_out))

    def _mine(self, p: torch.Tensor, whole: int, dim: int = 0) -> torch.Tensor:
        """This rank's 1/n of `p` along `dim` (`whole` entries unsplit), from the whole parameter or
        from its tensor-parallel shard (rank i // (n/tp) of tp holds parts [i - i % (n/tp), ...))."""
        t, (i, n) = local(p), self.share
        part = whole // n
        return t if t.shape[dim] == part else t.narrow(dim, i * part % t.shape[dim], part)

    def _project(self, linear: Linear, x: torch.Tensor, whole: int) -> torch.Tensor:
        return linear.project(x, self._mine(linear.weight, whole))


def qkv_order(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """The reference's row of in_proj_qkv (channel of the conv), laid out [q of all key heads | k of
    all | v of all], at each of ours, laid out by key head j: [q_j | k_j | v of j's H/Hk value heads].
    A contiguous 1/n of ours is 1/n of the key heads with their value heads."""
    qk, v = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    q_j, k_j, v_j = (t.view(num_k_heads, -1) for t in torch.arange(2 * qk + v).split([qk, qk, v]))
    return torch.cat([q_j, k_j, v_j], 1).flatten()


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) (in fp32, cast back) * silu(gate) (in fp32), over the last dim."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * n * F.silu(gate.float())).to(x.dtype)


# ------------------------------------------------------------------ documents
def position_in_document(bounds: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """(B, S) index of each token inside its document; `bounds` sorted over the flattened B*S
    tokens, row ends included (repeats are empty documents)."""
    t = torch.arange(B * S, device=bounds.device)
    doc = torch.searchsorted(bounds.long(), t, right=True) - 1
    return (t - bounds.long()[doc]).view(B, S)


def conv_by_doc(x_BSC: torch.Tensor, w_CK: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv whose window never reaches before its token's document start: tap i
    reads the token K-1-i back, kept only where that token is in the same document.  Summed in fp32
    (as a conv kernel accumulates), returned in x's dtype."""
    K, S = w_CK.shape[1], x_BSC.shape[1]
    xpad, w_CK = F.pad(x_BSC, (0, 0, K - 1, 0)).float(), w_CK.float()
    out = xpad[:, K - 1 :] * w_CK[:, K - 1]
    for i in range(K - 1):
        keep_BS1 = (pos_BS >= K - 1 - i).unsqueeze(-1)
        out = out + xpad[:, i : i + S] * w_CK[:, i] * keep_BS1
    return out.to(x_BSC.dtype)


# ------------------------------------------------------------------ delta rule
def gated_delta_rule(
    q, k, v, g, beta, bounds, chunk_size: int = 64, backend: str = "auto", num_chunks=None
):
    """The delta rule with query/key L2-normalized and queries scaled by Kd^-0.5 (Qwen3.5's use)
    through the chosen backend; flattened tokens, documents between `bounds`.  `v` may come by key
    head (T, Hk, H/Hk * Vd): the copy to (T, H, Vd) is made here, inside the core's region, so a
    recompute of the region saves the projection's output only."""
    v = v.reshape(v.shape[0], g.shape[-1], -1)
    if backend == "auto":
        fla_fits = q.is_cuda and q.dtype in FLA_DTYPES and fla_missing() is None
        backend = "fla" if fla_fits else "torch"
    if backend == "fla":
        return _fla_chunk(q, k, v, g, beta, bounds)
    if backend == "modelled":
        from moevlm.model.gdn_modelled import modelled_fla_chunk

        return modelled_fla_chunk(q, k, v, g, beta, bounds)
    return chunk_gated_delta_rule(
        q, k, v, g, beta, bounds, chunk_size, qk_l2norm=True, num_chunks=num_chunks
    )


def chunk_gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    bounds: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    qk_l2norm: bool = False,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """Per token t of a document: S = exp(g_t) S + k_t beta_t (v_t - S^T k_t)^T, o_t = S^T (scale q_t),
    S (Kd, Vd) per value head starting at zero in every document; computed in chunks of L tokens in
    fp32 (autocast off), the result in v's dtype.  Each document is laid out from a chunk start (zero-padded), so a
    chunk holds one document's tokens and the state is zeroed at a document's first chunk.
    `bounds`: sorted boundaries over T including 0 and T (None: one document); key heads repeat
    over value heads (head h serves value heads h*H/Hk ...).  `num_chunks`: the grid's N where the
    caller knows it (at least the documents' chunks), else the bound T // L + documents."""
    T, H = g_TH.shape
    if bounds is None:
        bounds = torch.tensor([0, T], device=g_TH.device)
    q, k = (x.repeat_interleave(H // x.shape[1], dim=1).float() for x in (q_THK, k_THK))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    layout = ChunkLayout(bounds.long(), T, chunk_size, num_chunks)
    grids = [layout.to_grid(x.float()) for x in (q, k, v_THV, g_TH, beta_TH)]
    with torch.autocast(v_THV.device.type, enabled=False):  # its matmuls stay fp32
        o = delta_rule_over_chunks(*grids, layout.first_chunk_N, waves=layout.waves)
    return layout.from_grid(o).to(v_THV.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class ChunkLayout:
    """Where each token goes in a grid of N chunks of L slots, each document from a chunk start;
    N = T // L + documents bounds every layout, so nothing waits on the host.  On the CPU, `waves`
    also lists the grid's chunks by their place in their document (wave c: chunk c of every document
    that long, longest documents first), so the recurrence steps through the longest document's
    chunks, the documents side by side, not through every chunk in turn."""

    def __init__(self, bounds: torch.Tensor, T: int, L: int, num_chunks: int | None = None):
        num_docs = bounds.numel() - 1
        lengths = bounds[1:] - bounds[:-1]
        chunks_D = (lengths + L - 1) // L
        first_D = torch.cumsum(chunks_D, 0) - chunks_D  # first chunk of every document
        t = torch.arange(T, device=bounds.device)
        doc_T = torch.searchsorted(bounds, t, right=True) - 1
        self.slot_T = first_D[doc_T] * L + t - bounds[doc_T]
        self.N, self.L = num_chunks or T // L + num_docs, L
        first = torch.zeros(self.N + 1, dtype=torch.bool, device=bounds.device)
        self.first_chunk_N = first.index_fill(0, first_D, True)[: self.N]
        self.waves = waves(chunks_D.tolist(), first_D.tolist()) if not bounds.is_cuda else None

    def to_grid(self, x_T: torch.Tensor) -> torch.Tensor:
        """(T, H, ...) → (H, N, L, ...), zeros in the slots no token fills."""
        grid = x_T.new_zeros(self.N * self.L, *x_T.shape[1:]).index_copy(0, self.slot_T, x_T)
        grid = grid.view(self.N, self.L, *x_T.shape[1:])
        return grid.movedim(2, 0)

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """(H, N, L, Vd) → (T, H, Vd)."""
        H, Vd = grid.shape[0], grid.shape[-1]
        return grid.movedim(0, 2).reshape(self.N * self.L, H, Vd)[self.slot_T]


def waves(chunks_D: list[int], first_D: list[int]) -> list[torch.Tensor]:
    """Grid chunk indices by wave: wave c holds chunk c of every document of more than c chunks, the
    documents in one order (most chunks first), so each wave's documents are a prefix of the last's."""
    order = sorted(range(len(chunks_D)), key=lambda d: -chunks_D[d])
    longest = chunks_D[order[0]] if order else 0
    return [
        torch.tensor([first_D[d] + c for d in order if chunks_D[d] > c]) for c in range(longest)
    ]


def delta_rule_over_chunks(
    q, k, v, g, beta, first_chunk_N: torch.Tensor, waves: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """q, k (H, N, L, Kd), v (H, N, L, Vd), g, beta (H, N, L), fp32 → o (H, N, L, Vd).  Inside a
    chunk the L delta-rule writes are one unit-lower-triangular solve (the WY/UT form); across
    chunks the state is carried in order, zeroed where a document begins, or with `waves`
    (ChunkLayout) carried for all documents side by side, each from zero."""
    H, N, L, Kd = k.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
    gcum = g.cumsum(-1)  # log decay from the chunk start to each position
    decay_LL = (gcum.unsqueeze(-1) - gcum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay_LL  # read as unit lower triangular
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * gcum.exp().unsqueeze(-1)], -1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1] :]  # writes if S=0; what S subtracts
    qk = (q @ k.transpose(-1, -2)) * decay_LL
    q_dec = q * gcum.exp().unsqueeze(-1)
    k_dec = k * (gcum[..., -1:] - gcum).exp().unsqueeze(-1)
    chunk_decay = gcum[..., -1].exp()[..., None, None]
    if waves is not None:
        return _over_waves(u, w, qk, q_dec, k_dec, chunk_decay, waves)
    keep_N = (~first_chunk_N).to(q.dtype)
    state = q.new_zeros(H, Kd, v.shape[-1])
    out = []
    # one unbind a tensor (its backward one stack), not an index per chunk (a whole-grid gradient each)
    for keep, u_n, w_n, qd_n, qk_n, cd_n, kd_n in zip(
        keep_N.unbind(0), *(x.unbind(1) for x in (u, w, q_dec, qk, chunk_decay, k_dec))
    ):
        state = state * keep
        v_new = u_n - w_n @ state
        out.append(qd_n @ state + qk_n @ v_new)
        state = state * cd_n + kd_n.transpose(-1, -2) @ v_new
    return torch.stack(out, 1)


def _over_waves(u, w, qk, q_dec, k_dec, chunk_decay, waves) -> torch.Tensor:
    """The state recurrence of delta_rule_over_chunks, one wave of documents' chunks a step: the
    chunks gathered wave after wave once and split by wave (backward: one cat, one scatter)."""
    H, N, L, Vd = u.shape
    if not waves:
        return u.new_zeros(H, N, L, Vd)
    order, sizes = torch.cat(waves), [idx.numel() for idx in waves]
    parts = [
        x.index_select(1, order).split(sizes, 1) for x in (u, w, qk, q_dec, k_dec, chunk_decay)
    ]
    state = u.new_zeros(H, sizes[0], k_dec.shape[-1], Vd)
    out = []
    for n, u_c, w_c, qk_c, qd_c, kd_c, cd_c in zip(sizes, *parts):
        s = state[:, :n]  # the documents still running
        v_new = u_c - w_c @ s
        out.append(qd_c @ s + qk_c @ v_new)
        state = s * cd_c + kd_c.transpose(-1, -2) @ v_new
    return u.new_zeros(H, N, L, Vd).index_copy(1, order, torch.cat(out, 1))


# ------------------------------------------------------------------ fla
def fla_missing() -> str | None:
    """None where flash-linear-attention's chunked kernel imports, else why not."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as e:
        return f"the optional package 'flash-linear-attention' ({e})"
    return None


def _fla_chunk(q, k, v, g, beta, bounds):
    """flash-linear-attention's kernel on the flattened tokens as one batch row of documents."""
    why = fla_missing() or (not q.is_cuda and "CUDA tensors")
    why = why or (q.dtype not in FLA_DTYPES and f"bf16 or fp16 inputs (not {q.dtype})")
    if why:
        raise RuntimeError(f"gdn backend='fla' needs {why}; use backend='torch' or 'auto'")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    H = v.shape[1]
    q, k = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (q, k))
    cu = torch.unique_consecutive(bounds.long())  # empty documents dropped (a host sync)
    o, _ = fla_chunk(
        q[None], k[None], v[None], g[None].float(), beta[None], cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0].to(v.dtype)
