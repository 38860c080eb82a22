"""Model configuration: vision, text, MoE and the whole VLM, with its presets, its checks and its
entry points to and from a Hugging Face `config.json` (moevlm.model.hf_config).

    cfg = VLMConfig.preset("tiny").validate()      # ConfigError naming the field and the fix
    cfg = VLMConfig.from_hf("path/to/config.json")
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moevlm.errors import ConfigError, check
from moevlm.kernels import GROUPED_GEMMS
from moevlm.model import hf_config

ATTN_BACKENDS = ("auto", "sdpa", "sdpa_per_doc", "flex", "flash", "varlen")
PERMUTES = ("torch", "triton")  # moe.permute: the token permute/unpermute kernels
CAPACITY_OVERFLOWS = ("drop", "error")  # moe.capacity_overflow (moevlm.dispatch.capacity)
# moe.aux_loss (moevlm.model.moe): the load-balancing loss's form
AUX_LOSSES = ("micro_batch", "global_batch", "sequence")
# fp8 (moevlm.model.fp8): recipes, the linears it may cover, GEMM backends
FP8_RECIPES = ("none", "blockwise", "mxfp8")
FP8_MODULES = ("experts", "attn", "mlp", "vision")
FP8_BACKENDS = ("auto", "triton", "torch", "emulate")


@dataclass
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row of `pixel_values`: C*T*P*P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # dense MLP width (mlp_only_layers)
    num_layers: int = 48
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # Qwen3.5's attention: q_proj also emits a per-head output gate (the attention output times its
    # sigmoid before o_proj), and rotary positions on the first partial_rotary_factor of each head
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    # Qwen3.5's RMSNorms scale by 1 + weight, the weight stored around 0 (moevlm.model.decoder.RMSNorm)
    norm_zero_centered: bool = False
    # Qwen3.5's hybrid decoder: per layer "full_attention" or "linear_attention" (Gated DeltaNet,
    # moevlm.model.gated_deltanet); empty: every layer full attention
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    def is_linear_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` is a Gated DeltaNet (linear attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary positions turn."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass
class MoEConfig:
    num_experts: int = 128
    top_k: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    grouped_gemm: str = "torch"  # see moevlm.kernels.GROUPED_GEMMS
    permute: str = "torch"  # token rows <-> expert rows: torch | triton (moevlm.model.rows)
    capacity_factor: float | None = (
        None  # alltoall only: None = dropless (moevlm.dispatch.capacity)
    )
    capacity_overflow: str = "drop"  # drop (and count) | error (the trainer fails the step)
    # the load-balancing loss's form: micro_batch (the reference's) | global_batch | sequence
    aux_loss: str = "micro_batch"
    router_bias_rate: float = 0.0  # aux-loss-free balancing: the expert bias's step (0 = off)
    z_loss_coeff: float = 0.0  # router z-loss weight (0 = off)
    router_force_balance: bool = False  # benchmarks only: even routing whatever the scores
    # a shared expert beside the routed ones: a SwiGLU of this width over every token, scaled by a
    # sigmoid gate (Qwen3.5-MoE); 0 = none
    shared_expert_intermediate_size: int = 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """The reference's rule: sparse unless listed dense or off the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class Fp8Config:
    """FP8 training (moevlm.model.fp8): which recipe, for which linears, through which kernels."""

    recipe: str = "none"  # none | blockwise | mxfp8
    modules: tuple[str, ...] = ("experts", "attn", "mlp")  # see moevlm.model.config.FP8_MODULES
    backend: str = "auto"  # auto | triton | torch | emulate
    pow2_scales: bool = False  # blockwise scales rounded up to powers of two
    cache_weights: bool = True  # weight codes kept from the first micro-batch of a step to its last
    pad_experts: bool = False  # each expert's rows padded to the scale block (local dispatcher)


LORA_ROUTER = ("frozen", "trained")


@dataclass
class LoraConfig:
    """LoRA adapters (moevlm.model.lora): rank 0 = off; alpha None = 2 x rank (scale 2 at any rank)."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    modules: tuple[str, ...] = ("attn",)  # scopes of FP8_MODULES: experts, attn, mlp, vision
    router: str = "frozen"  # frozen | trained

    @property
    def alpha_value(self) -> float:
        return 2.0 * self.rank if self.alpha is None else self.alpha

    @property
    def scale(self) -> float:
        return self.alpha_value / self.rank


@dataclass
class VLMConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    attn_backend: str = "auto"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # the LM head's loss over chunks of this many tokens, without the logits (0: the whole logits)
    loss_chunk_tokens: int = 0

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> "VLMConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]()

    # --------------------------------------------------------------- validation
    def validate(self) -> "VLMConfig":
        v, t, m = self.vision, self.text, self.moe
        self._check_numbers()
        check(
            v.hidden_size % v.num_heads == 0,
            f"vision.hidden_size={v.hidden_size} is not divisible by vision.num_heads={v.num_heads}",
        )
        check(
            v.head_dim % 4 == 0,
            f"vision head dim {v.head_dim} (vision.hidden_size/vision.num_heads) must be a multiple "
            "of 4 for the 2-D rotary embedding",
        )
        side = math.isqrt(v.num_position_embeddings)
        check(
            side * side == v.num_position_embeddings,
            f"vision.num_position_embeddings={v.num_position_embeddings} must be a perfect square",
        )
        for i in v.deepstack_visual_indexes:
            check(
                0 <= i < v.depth,
                f"vision.deepstack_visual_indexes={list(v.deepstack_visual_indexes)} has {i}, outside "
                f"0..vision.depth-1={v.depth - 1}",
            )
        check(
            len(v.deepstack_visual_indexes) <= t.num_layers,
            f"{len(v.deepstack_visual_indexes)} deepstack features but only text.num_layers={t.num_layers}",
        )
        check(
            t.num_heads % t.num_kv_heads == 0,
            f"text.num_heads={t.num_heads} is not divisible by text.num_kv_heads={t.num_kv_heads}",
        )
        check(t.head_dim % 2 == 0, f"text.head_dim={t.head_dim} must be even")
        check(
            not t.layer_types
            or (
                len(t.layer_types) == t.num_layers
                and set(t.layer_types) <= {"full_attention", "linear_attention"}
            ),
            f"text.layer_types={tuple(t.layer_types)} must name each of the text.num_layers="
            f"{t.num_layers} layers full_attention or linear_attention (or be empty: all full)",
        )
        check(
            0 < t.partial_rotary_factor <= 1 and t.rotary_dim % 2 == 0,
            f"text.partial_rotary_factor={t.partial_rotary_factor} must be in (0, 1] and turn an even "
            f"number of each head's {t.head_dim} dims",
        )
        check(
            len(t.mrope_section) == 3 and sum(t.mrope_section) == t.rotary_dim // 2,
            f"text.mrope_section={tuple(t.mrope_section)} must have 3 entries summing to "
            f"the rotary dims/2={t.rotary_dim // 2} (text.head_dim x text.partial_rotary_factor / 2)",
        )
        check(m.num_experts >= 0, f"moe.num_experts={m.num_experts} must be >= 0")
        if m.num_experts:
            check(
                1 <= m.top_k <= m.num_experts,
                f"moe.top_k={m.top_k} must be in 1..moe.num_experts={m.num_experts}",
            )
        check(
            m.decoder_sparse_step >= 1,
            f"moe.decoder_sparse_step={m.decoder_sparse_step} must be >= 1",
        )
        for i in m.mlp_only_layers:
            check(
                0 <= i < t.num_layers, f"moe.mlp_only_layers has {i}, outside 0..{t.num_layers - 1}"
            )
        check(
            m.capacity_factor is None or _real(m.capacity_factor) and m.capacity_factor > 0,
            f"moe.capacity_factor={m.capacity_factor!r} must be a finite number > 0 (1.0: the balanced load per "
            "expert), or None (null) for the dropless all-to-all",
        )
        check(
            m.capacity_overflow in CAPACITY_OVERFLOWS,
            f"moe.capacity_overflow={m.capacity_overflow!r}; choose one of {list(CAPACITY_OVERFLOWS)}",
        )
        check(
            m.aux_loss in AUX_LOSSES,
            f"moe.aux_loss={m.aux_loss!r}; choose one of {list(AUX_LOSSES)}",
        )
        check(
            isinstance(m.router_force_balance, bool),
            f"moe.router_force_balance={m.router_force_balance!r} must be true or false",
        )
        check(m.permute in PERMUTES, f"moe.permute={m.permute!r}; choose one of {list(PERMUTES)}")
        check(
            "triton" not in (m.permute, m.grouped_gemm) or _has_triton(),
            "moe.permute / moe.grouped_gemm = 'triton' need the package 'triton' (pip install triton; CUDA "
            "builds of torch ship it); use 'torch'",
        )
        check(
            m.grouped_gemm in GROUPED_GEMMS,
            f"moe.grouped_gemm={m.grouped_gemm!r}; choose one of {sorted(GROUPED_GEMMS)}",
        )
        check(
            m.grouped_gemm != "torch"
            or (t.hidden_size % 8 == 0 and m.moe_intermediate_size % 8 == 0),
            f"moe.grouped_gemm='torch' (torch._grouped_mm) needs 16-byte rows: text.hidden_size="
            f"{t.hidden_size} and moe.moe_intermediate_size={m.moe_intermediate_size} must be multiples "
            "of 8; use moe.grouped_gemm='loop' or change the sizes",
        )
        check(
            self.attn_backend in ATTN_BACKENDS,
            f"attn_backend={self.attn_backend!r}; choose one of {ATTN_BACKENDS}",
        )
        chunk = self.loss_chunk_tokens
        check(
            isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0,
            f"loss_chunk_tokens={chunk!r} must be an integer >= 0 (0: the whole micro-batch's logits)",
        )
        self._check_fp8()
        self._check_lora()
        for name in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        ):
            tok = getattr(self, name)
            check(
                0 <= tok < t.vocab_size,
                f"{name}={tok} is outside the vocabulary (text.vocab_size={t.vocab_size})",
            )
        return self

    def _check_fp8(self) -> None:
        f = self.fp8
        check(
            f.recipe in FP8_RECIPES, f"fp8.recipe={f.recipe!r}; choose one of {list(FP8_RECIPES)}"
        )
        check(
            f.backend in FP8_BACKENDS,
            f"fp8.backend={f.backend!r}; choose one of {list(FP8_BACKENDS)}",
        )
        check_fp8_modules(f.modules)
        check(
            f.recipe == "none" or bool(f.modules),
            "fp8.recipe is set but fp8.modules (model.fp8_modules) is "
            "empty: name the "
            f"linears to run in FP8 ({list(FP8_MODULES)}) or set none",
        )
        check(
            not f.pow2_scales or f.recipe != "mxfp8",
            "fp8.pow2_scales is a blockwise option (MXFP8 scales are powers of two already)",
        )

    def _check_lora(self) -> None:
        lo, m = self.lora, self.moe
        check(
            isinstance(lo.rank, int) and not isinstance(lo.rank, bool) and lo.rank >= 0,
            f"lora.rank={lo.rank!r} must be an integer >= 0 (0: no adapters)",
        )
        check(
            lo.alpha is None or _real(lo.alpha) and lo.alpha > 0,
            f"lora.alpha={lo.alpha!r} must be a number > 0, or null for 2 x lora.rank",
        )
        check(
            _real(lo.dropout) and 0 <= lo.dropout < 1,
            f"lora.dropout={lo.dropout!r} must be in [0, 1)",
        )
        bad = sorted(set(lo.modules) - set(FP8_MODULES))
        check(not bad, f"lora.modules has {bad}; choose among {list(FP8_MODULES)}")
        check(
            lo.router in LORA_ROUTER,
            f"lora.router={lo.router!r}; choose one of {list(LORA_ROUTER)}",
        )
        if not lo.rank:
            return
        check(
            "experts" not in lo.modules or m.grouped_gemm != "torch" or lo.rank % 8 == 0,
            f"lora.rank={lo.rank} with expert adapters and moe.grouped_gemm='torch' (torch._grouped_mm "
            "needs 16-byte rows): use a multiple of 8, or moe.grouped_gemm='loop'",
        )

    def _check_numbers(self) -> None:
        """Sizes are positive integers and real-valued fields finite (nan passes a `>= 0` test
        written as `not x < 0`, and inf passes most): first, so no later check divides by zero."""
        v, t, m = self.vision, self.text, self.moe
        sizes = {
            "vision": (
                "depth",
                "hidden_size",
                "intermediate_size",
                "num_heads",
                "in_channels",
                "patch_size",
                "temporal_patch_size",
                "spatial_merge_size",
                "out_hidden_size",
                "num_position_embeddings",
            ),
            "text": (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "max_position_embeddings",
            ),
            "moe": ("top_k", "moe_intermediate_size") if m.num_experts else (),
        }
        for section, names in sizes.items():
            for name in names:
                value = getattr(getattr(self, section), name)
                check(
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"{section}.{name}={value!r} must be a positive integer",
                )
        positive = {
            "vision.layer_norm_eps": v.layer_norm_eps,
            "vision.rope_theta": v.rope_theta,
            "text.rms_norm_eps": t.rms_norm_eps,
            "text.rope_theta": t.rope_theta,
        }
        for name, value in positive.items():
            check(_real(value) and value > 0, f"{name}={value!r} must be a finite number > 0")
        non_negative = {
            "moe.router_aux_loss_coef": m.router_aux_loss_coef,
            "moe.router_bias_rate": m.router_bias_rate,
            "moe.z_loss_coeff": m.z_loss_coeff,
            "vision.initializer_range": v.initializer_range,
            "text.initializer_range": t.initializer_range,
        }
        for name, value in non_negative.items():
            check(_real(value) and value >= 0, f"{name}={value!r} must be a finite number >= 0")

    # ------------------------------------------------------- Hugging Face JSON
    @property
    def family(self) -> str:
        """ "qwen3_5_moe" when any Qwen3.5-MoE option is on (Gated DeltaNet layers, a shared expert,
        zero-centred norms, gated attention), else "qwen3_vl_moe": the config.json form it writes."""
        t = self.text
        qwen35 = (
            "linear_attention" in t.layer_types
            or self.moe.shared_expert_intermediate_size > 0
            or t.norm_zero_centered
            or t.attn_output_gate
        )
        return "qwen3_5_moe" if qwen35 else "qwen3_vl_moe"

    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | Path) -> "VLMConfig":
        """Build from a Hugging Face Qwen3-VL-MoE or Qwen3.5-MoE `config.json` (dict, file or folder);
        what is read, ignored and refused: moevlm.model.hf_config."""
        if not isinstance(hf, dict):
            path = Path(hf)
            path = path / "config.json" if path.is_dir() else path
            hf = json.loads(path.read_text())
        parts = hf_config.read(hf)
        return cls(
            vision=VisionConfig(**parts.pop("vision")),
            text=TextConfig(**parts.pop("text")),
            moe=MoEConfig(**parts.pop("moe")),
            **parts,
        ).validate()

    def to_hf(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The Hugging Face `config.json` dict of this architecture, in its family's form (`family`)."""
        return hf_config.write(self, dtype)

    def replace(self, **changes) -> "VLMConfig":
        """A copy with top-level fields replaced (nested configs are copied too)."""
        out = dataclasses.replace(
            self,
            vision=dataclasses.replace(self.vision),
            text=dataclasses.replace(self.text),
            moe=dataclasses.replace(self.moe),
            fp8=dataclasses.replace(self.fp8),
            lora=dataclasses.replace(self.lora),
        )
        return dataclasses.replace(out, **changes)


def check_fp8_modules(modules) -> None:
    """Every name in `modules` (fp8.modules; VLMConfig.validate and moevlm.model.fp8_targets.apply_fp8) is one of
    FP8_MODULES."""
    bad = sorted(set(modules) - set(FP8_MODULES))
    check(
        not bad,
        f"fp8.modules (model.fp8_modules) has {bad}; choose among {list(FP8_MODULES)} (the router, "
        "norms, embeddings and LM head always stay in high precision)",
    )


def _real(value) -> bool:
    """A finite int or float (not bool, not nan, not +-inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------- presets
def tiny() -> VLMConfig:
    """CPU-test size: every architectural feature present, dims chosen so no expert
    weight is square (2F != D, F != D) and hub/transformers layouts stay distinguishable."""
    return VLMConfig(
        vision=VisionConfig(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=(0,),
        ),
        text=TextConfig(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=96,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            mrope_section=(4, 2, 2),
            max_position_embeddings=4096,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=48),
        image_token_id=1020,
        video_token_id=1021,
        vision_start_token_id=1018,
        vision_end_token_id=1019,
    )


def qwen3_vl_30b_a3b() -> VLMConfig:
    """Qwen/Qwen3-VL-30B-A3B-Instruct."""
    return VLMConfig(vision=VisionConfig(out_hidden_size=2048), text=TextConfig(), moe=MoEConfig())


def qwen3_vl_235b_a22b() -> VLMConfig:
    """Qwen/Qwen3-VL-235B-A22B-Instruct."""
    return VLMConfig(
        vision=VisionConfig(out_hidden_size=4096),
        text=TextConfig(
            hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64, num_kv_heads=4
        ),
        moe=MoEConfig(moe_intermediate_size=1536),
    )


def qwen3_5_tiny() -> VLMConfig:
    """CPU-test size Qwen3.5-MoE: Gated DeltaNet layers (3 of 4, the reference's interval) beside gated
    full attention, partial rotary, zero-centred norms, a shared expert, no deepstack; the sizes of
    `tiny` (no expert weight square), the GDN heads small and unequal."""
    cfg = tiny()
    t = dataclasses.replace(
        cfg.text,
        intermediate_size=TextConfig.intermediate_size,  # no dense layer: unused, as from_hf leaves it
        num_layers=4,
        layer_types=tuple(hf_config.interval_layer_types(4, {})),
        attn_output_gate=True,
        partial_rotary_factor=0.5,
        norm_zero_centered=True,
        mrope_section=(2, 1, 1),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
    )
    moe = dataclasses.replace(cfg.moe, shared_expert_intermediate_size=40)
    vision = dataclasses.replace(cfg.vision, deepstack_visual_indexes=())
    return dataclasses.replace(cfg, text=t, moe=moe, vision=vision)


def qwen3_5_35b_a3b() -> VLMConfig:
    """Qwen/Qwen3.5-35B-A3B: transformers' Qwen3_5MoeConfig defaults (documented as that checkpoint:
    sizes, GDN dims, experts, token ids, M-RoPE (11, 11, 10) over a quarter of each head; read by
    moevlm.model.hf_config) with the hub config.json's own rope_theta 1e7, 262144 positions and the
    vision tower's output width, 2048 (the reference's default, 3584, is not the checkpoint's)."""
    return VLMConfig.from_hf(
        {
            "model_type": "qwen3_5_moe",
            "text_config": {
                "rope_parameters": {"rope_theta": 10_000_000.0},
                "max_position_embeddings": 262144,
            },
            "vision_config": {"out_hidden_size": 2048},
        }
    )


PRESETS = {
    "tiny": tiny,
    "qwen3_vl_30b_a3b": qwen3_vl_30b_a3b,
    "qwen3_vl_235b_a22b": qwen3_vl_235b_a22b,
    "qwen3_5_tiny": qwen3_5_tiny,
    "qwen3_5_35b_a3b": qwen3_5_35b_a3b,
}


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
