"""The job's `model` section: the network, its proxy knobs, kernels and dispatcher, and the model
config (moevlm.model.VLMConfig) it composes.

    cfg = model_config(job.model)       # the preset or HF config with every declared field set

A field with `sets` metadata is that VLMConfig field (`edits`: a proxy, applied when not null); one
with `spec` is that field of the dispatcher spec (moevlm.dispatch.DispatcherSpec).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf

from moevlm.config.dispatcher import choose_dispatcher
from moevlm.data.checks import shown_path
from moevlm.dispatch import dispatcher_names
from moevlm.dispatch.base import DEEPEP_APIS
from moevlm.errors import ConfigError, check
from moevlm.fields import is_int, one_of
from moevlm.model.config import (
    ATTN_BACKENDS,
    AUX_LOSSES,
    CAPACITY_OVERFLOWS,
    FP8_BACKENDS,
    FP8_MODULES,
    FP8_RECIPES,
    LORA_ROUTER,
    PERMUTES,
    PRESETS,
    VLMConfig,
)
from moevlm.parallel.cuda_graphs import SCOPES as GRAPH_SCOPES
from moevlm.parallel.cuda_graphs import scope_problem
from moevlm.parallel.offload import MODULES as OFFLOAD_MODULES
from moevlm.parallel.offload import check as check_offload
from moevlm.parallel.recompute import COLLECTIVES as RECOMPUTE_COLLECTIVES
from moevlm.parallel.recompute import MODES as RECOMPUTE_MODES
from moevlm.parallel.recompute import MODULES as RECOMPUTE_MODULES
from moevlm.parallel.recompute import check as check_recompute

PRESET_NAMES = tuple(sorted(PRESETS))
# every expert-GEMM backend; moevlm.kernels.GROUPED_GEMMS holds those importable here (triton needs the package)
GROUPED_GEMM_BACKENDS = ("loop", "torch", "triton")


@dataclass
class ModelConfig:
    """The network: a preset or an HF config, proxy knobs that shrink it, kernel and dispatcher backends. An
    option marked [VLMConfig.x] is field x of the model config (moevlm.model.VLMConfig); one marked
    [DispatcherSpec.x] is field x of the dispatcher spec (moevlm.dispatch.DispatcherSpec)."""

    preset: one_of(*PRESET_NAMES, checked_by=VLMConfig.preset) = field(
        default="tiny",
        metadata={"help": "the architecture by name (ignored when hf_config is set)"},
    )
    family: one_of("auto", "qwen3_vl_moe", "qwen3_5_moe") = field(
        default="auto",
        metadata={
            "help": "the model family (auto = model.preset's or model.hf_config's); given with the "
            "default model.preset, that family's tiny preset; refused when the preset or config is "
            "of the other family"
        },
    )
    hf_config: str = field(
        default="",
        metadata={
            "help": "an HF Qwen3-VL-MoE or Qwen3.5-MoE config.json (or its folder) as the architecture; "
            "empty = model.preset"
        },
    )
    hf_checkpoint: str = field(
        default="",
        metadata={"help": "an HF folder (safetensors) to load weights from; empty = random init"},
    )
    num_layers: Optional[int] = field(
        default=None,
        metadata={
            "edits": "text.num_layers",
            "help": "proxy: fewer decoder layers (a hybrid model's layer_types cut to them, or repeated "
            "when more); null = the model's own",
        },
    )
    num_experts: Optional[int] = field(
        default=None,
        metadata={
            "edits": "moe.num_experts",
            "help": "proxy: fewer experts (0: a dense MLP in every layer); null = the model's own",
        },
    )
    vision_depth: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision.depth",
            "help": "proxy: fewer vision blocks (deepstack taps beyond it dropped); null = the model's own",
        },
    )
    vision_taps: Optional[List[int]] = field(
        default=None,
        metadata={
            "edits": "vision.deepstack_visual_indexes",
            "help": "proxy: the vision blocks whose outputs feed the deepstack mergers, in order (with "
            "model.vision_depth: the planner's short towers); null = the model's own",
        },
    )
    # the token ids: a randomly initialized model can take the ids of the data's tokenizer (the sample
    # set's tiny BPE with a large model's proxy); a checkpoint's model keeps its own
    vocab_size: Optional[int] = field(
        default=None,
        metadata={
            "edits": "text.vocab_size",
            "help": "the vocabulary (embedding and output rows): at least the tokenizer's ids; null = the "
            "model's own",
        },
    )
    image_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "image_token_id",
            "help": "the tokenizer's <|image_pad|> id; null = the model's own",
        },
    )
    video_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "video_token_id",
            "help": "the tokenizer's <|video_pad|> id; null = the model's own",
        },
    )
    vision_start_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision_start_token_id",
            "help": "the tokenizer's <|vision_start|> id; null = the model's own",
        },
    )
    vision_end_token_id: Optional[int] = field(
        default=None,
        metadata={
            "edits": "vision_end_token_id",
            "help": "the tokenizer's <|vision_end|> id; null = the model's own",
        },
    )
    attn_backend: one_of(*ATTN_BACKENDS, checked_by=VLMConfig.validate) = field(
        default="auto",
        metadata={
            "sets": "attn_backend",
            "help": "attention kernel: auto (on CUDA in bf16/fp16, autocast's dtype counted, the first "
            "available of flash, varlen, flex, sdpa; sdpa on CUDA in fp32; on the CPU sdpa_per_doc, or "
            "sdpa under train.compile), sdpa (one call, dense document mask), sdpa_per_doc (one call "
            "per document: only the useful scores, a host loop), flex (FlexAttention), flash (flash-attn "
            "varlen), varlen (torch.nn.attention.varlen, CUDA only, no extra package)",
        },
    )
    grouped_gemm: one_of(*GROUPED_GEMM_BACKENDS, checked_by=VLMConfig.validate) = field(
        default="torch",
        metadata={
            "sets": "moe.grouped_gemm",
            "help": "expert GEMM: torch (torch._grouped_mm), loop (one matmul per expert, the reference), triton "
            "(ours; needs the triton package)",
        },
    )
    dispatcher: one_of("auto", *dispatcher_names(), checked_by=choose_dispatcher) = field(
        default="auto",
        metadata={
            "spec": "name",
            "help": "how tokens reach their experts (moevlm.dispatch): auto (local when parallel.ep x etp == 1, else "
            "alltoall), local (no expert parallelism, parallel.ep=1), alltoall, deepep (DeepEP's V2 ElasticBuffer, "
            "else its V1 Buffer: needs the deep_ep package, CUDA only, and an EP group of 2, 4, 8 or a "
            "multiple of 8 ranks), hybridep "
            "(DeepEP's hybrid-ep branch, HybridEPBuffer: CUDA only, experts-per-rank x ranks-per-node a multiple "
            "of 4); neither was run on a real GPU cluster by moevlm yet; one that cannot run is refused, or "
            "replaced as model.dispatcher_fallback says",
        },
    )
    dispatcher_fallback: one_of("none", "alltoall") = field(
        default="none",
        metadata={
            "help": "when model.dispatcher (deepep, hybridep) cannot run here (package missing or broken, adapter not "
            "built, or a layout it cannot take): none (refuse with the reason) or alltoall (run the alltoall "
            "dispatcher instead; one note in the start-up log says why)"
        },
    )
    permute: one_of(*PERMUTES, checked_by=VLMConfig.validate) = field(
        default="torch",
        metadata={
            "sets": "moe.permute",
            "help": "token permute/unpermute around the experts: torch, or triton (fused kernels)",
        },
    )
    moe_capacity_factor: Optional[float] = field(
        default=None,
        metadata={
            "sets": "moe.capacity_factor",
            "help": "null = dropless (exact; the alltoall dispatcher syncs with the host once per MoE layer). A number "
            "f > 0: the capacity all-to-all (moevlm.dispatch.capacity): each rank sends each expert at most "
            "C = ceil(f x tokens x top_k / num_experts) rows through fixed-size buffers, no host sync; "
            "choices over C are dropped (the earliest tokens kept) and logged as moe_dropped_tokens in "
            "metrics.jsonl. Needs the alltoall dispatcher (model.dispatcher=alltoall, or auto with "
            "parallel.ep > 1) or hybridep (a static num_permuted_tokens of E x C rows per receiving rank; "
            "HybridEP drops the last permuted rows and flags it), and parallel.etp=1",
        },
    )
    moe_capacity_overflow: one_of(*CAPACITY_OVERFLOWS, checked_by=VLMConfig.validate) = field(
        default="drop",
        metadata={
            "sets": "moe.capacity_overflow",
            "help": "with model.moe_capacity_factor: drop (drop and count the choices over capacity) or error (the "
            "step fails, naming the fix, when any choice is dropped)",
        },
    )
    deepep_api: one_of(*DEEPEP_APIS) = field(
        default="auto",
        metadata={
            "spec": "api",
            "help": "with model.dispatcher=deepep: which DeepEP API drives it: auto (V2's ElasticBuffer where the "
            "installed deep_ep has it, else V1's Buffer), v2, or v1 (EP sizes 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, "
            "144, 160 only, 8 ranks per node across nodes)",
        },
    )
    dispatcher_max_tokens_per_rank: Optional[int] = field(
        default=None,
        metadata={
            "spec": "max_tokens_per_rank",
            "help": "with model.dispatcher=deepep (V2) or hybridep: a fixed bound on the tokens any rank dispatches "
            "per MoE layer (micro_batch_size x seq_len), so no all-reduce of token counts runs per layer; a larger "
            "count fails the step; null = the group's largest count, all-reduced each time",
        },
    )
    dispatcher_num_sms: int = field(
        default=0,
        metadata={
            "spec": "num_sms",
            "help": "with model.dispatcher=deepep or hybridep: SMs their exchange kernels use (even); 0 = the "
            "backend's choice (DeepEP V1: 20; V2: its estimate, 24 where it cannot detect the RDMA bandwidth; "
            "HybridEP: its defaults)",
        },
    )
    moe_aux_loss: one_of(*AUX_LOSSES, checked_by=VLMConfig.validate) = field(
        default="micro_batch",
        metadata={
            "sets": "moe.aux_loss",
            "help": "the load-balancing loss's form (weight model.aux_loss_coef): micro_batch (the reference's: "
            "expert frequencies and mean probabilities of each micro-batch, pooled over layers), global_batch "
            "(the micro-batch's mean probabilities weighted by the frequencies of the step's micro-batches so "
            "far over every data-parallel rank, in global row order: moevlm.parallel.balance), sequence "
            "(DeepSeek-V3's sequence-wise loss: per layer and per packed document, averaged)",
        },
    )
    moe_router_bias_rate: float = field(
        default=0.0,
        metadata={
            "sets": "moe.router_bias_rate",
            "help": "aux-loss-free balancing (DeepSeek-V3), 0 = off: a per-expert bias added to the router "
            "probabilities for the choice of experts only, moved after every optimizer step by "
            "bias += rate x sign(mean load - load) from the step's load (all micro-batches and data-parallel "
            "ranks); saved in training checkpoints, never exported. Combine with model.aux_loss_coef=0 for "
            "DeepSeek-V3's recipe",
        },
    )
    moe_z_loss_coeff: float = field(
        default=0.0,
        metadata={
            "sets": "moe.z_loss_coeff",
            "help": "router z-loss weight, 0 = off: coeff x the mean over tokens of logsumexp(router logits)^2, "
            "summed over MoE layers and averaged over the step's micro-batches like the aux loss",
        },
    )
    moe_router_force_balance: bool = field(
        default=False,
        metadata={
            "sets": "moe.router_force_balance",
            "help": "benchmarks only: every MoE layer routes its tokens evenly (the token at position p of its "
            "sequence to experts (p x top_k + j) mod num_experts, the same under any split of the sequence) "
            "whatever the router scores, as published force-balanced throughputs are measured; logged at "
            "start and marked moe_router_force_balance in every metrics record",
        },
    )
    aux_loss_coef: Optional[float] = field(
        default=None,
        metadata={
            "edits": "moe.router_aux_loss_coef",
            "help": "router load-balancing loss weight (0 turns it off); null = the checkpoint's router_aux_loss_coef",
        },
    )
    freeze_vision: bool = field(
        default=False,
        metadata={
            "help": "the whole vision module (tower, merger, deepstack mergers) runs forward only, no gradients"
        },
    )
    loss_chunk_tokens: int = field(
        default=1024,
        metadata={
            "sets": "loss_chunk_tokens",
            "help": "the LM head's loss and its gradients computed this many tokens at a time "
            "(moevlm.model.linear_ce): a chunk's logits at most, never the micro-batch's (tokens x vocabulary "
            "in fp32, again for their gradient); the same loss and gradients to fp32 rounding. 0 = the whole "
            "micro-batch's logits at once",
        },
    )
    recompute: one_of(*RECOMPUTE_MODES, checked_by=check_recompute) = field(
        default="none",
        metadata={
            "help": "activation recompute in backward: none, selective (the regions of model.recompute_modules), full "
            "(each decoder layer and vision block whole); what happens to the collectives inside a recomputed "
            "region: model.recompute_collectives"
        },
    )
    recompute_collectives: one_of(*RECOMPUTE_COLLECTIVES, checked_by=check_recompute) = field(
        default="save",
        metadata={
            "help": "the collectives inside recomputed regions (expert all-to-all, tensor/context-parallel "
            "gathers): save keeps their outputs, so backward never exchanges twice; reissue recomputes them "
            "like any op, as Megatron's full recompute does: a layer keeps only its input, not its dispatched "
            "rows (about 2 x tokens x top-k x hidden bytes a MoE layer), and backward exchanges again"
        },
    )
    recompute_modules: List[one_of(*RECOMPUTE_MODULES, checked_by=check_recompute)] = field(
        default_factory=lambda: ["core_attn"],
        metadata={
            "help": "regions recomputed when model.recompute=selective (ignored otherwise): core_attn (attention "
            "kernel; Gated DeltaNet's chunked delta rule), layernorm, mlp (dense MLPs: mlp_only_layers and vision), moe_act (experts' SwiGLU), moe "
            "(whole MoE block), vision (each vision block)"
        },
    )
    offload_modules: List[one_of(*OFFLOAD_MODULES, checked_by=check_offload)] = field(
        default_factory=list,
        metadata={
            "help": "scopes whose activations saved for backward go to pinned host memory in forward and come back "
            "(prefetched one scope ahead, on a side stream) in backward (moevlm/parallel/offload.py): layer_input "
            "(each decoder layer's input, e.g. the one model.recompute=full keeps), core_attn (the attention core, "
            "and Gated DeltaNet's chunked delta rule), mlp, moe_act, moe, vision; a tensor recomputed in backward is never offloaded; [] = none"
        },
    )
    fp8: one_of(*FP8_RECIPES, checked_by=VLMConfig.validate) = field(
        default="none",
        metadata={
            "sets": "fp8.recipe",
            "help": "FP8 training of the linears in model.fp8_modules: none, blockwise (Hopper recipe: e4m3, 1x128 "
            "activation tiles, 128x128 weight blocks, fp32 scales) or mxfp8 (Blackwell: 1x32 blocks, e8m0 "
            "scales); fp32 master weights, the router always fp32 (moevlm.model.fp8)",
        },
    )
    fp8_modules: List[one_of(*FP8_MODULES, checked_by=VLMConfig.validate)] = field(
        default_factory=lambda: ["experts", "attn", "mlp"],
        metadata={
            "sets": "fp8.modules",
            "help": "what runs in FP8 when model.fp8 is set: experts (grouped GEMMs), attn (decoder q/k/v/o; "
            "Gated DeltaNet qkv, z and out projections), mlp (decoder dense MLPs, the shared expert), vision "
            "(vision blocks and mergers); router, gates, norms, embeddings and LM head never",
        },
    )
    fp8_backend: one_of(*FP8_BACKENDS, checked_by=VLMConfig.validate) = field(
        default="auto",
        metadata={
            "sets": "fp8.backend",
            "help": "FP8 kernels: auto (blockwise: ours on sm89+; mxfp8: torch where the probe finds Blackwell's "
            "paths; refused on the CPU), triton (ours, blockwise), torch (torch._scaled_mm / _scaled_grouped_mm "
            "where a probe finds them; pads expert rows), emulate (dequantize, fp64 GEMM: the recipe's numerics "
            "anywhere, slow)",
        },
    )
    fp8_pow2_scales: bool = field(
        default=False,
        metadata={
            "sets": "fp8.pow2_scales",
            "help": "blockwise: scales rounded up to powers of two (rescaling exact)",
        },
    )
    fp8_cache_weights: bool = field(
        default=True,
        metadata={
            "sets": "fp8.cache_weights",
            "help": "quantize each weight once per optimizer step and reuse it across micro-batches and backward (one "
            "byte per weight element kept until the step ends, unsharded under FSDP); false = at every use",
        },
    )
    fp8_pad_experts: bool = field(
        default=False,
        metadata={
            "sets": "fp8.pad_experts",
            "help": "pad each expert's rows to the scale block (128 / 32) so no weight-gradient scale block spans two "
            "experts (local dispatcher: up to block-1 zero rows per expert and a host sync per layer; hybridep: "
            "padded by HybridEP); "
            "fp8_backend=torch always pads",
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "sets": "lora.rank",
            "help": "LoRA adapters of this rank beside the linears of model.lora_modules (moevlm.model.lora); "
            "every base weight frozen, only adapters (and a trained router) get gradients and optimizer "
            "state (checkpoints hold them alone); 0 = off. Every layout",
        },
    )
    lora_alpha: Optional[float] = field(
        default=None,
        metadata={
            "sets": "lora.alpha",
            "help": "LoRA scale numerator: the update is (alpha / rank) B A x; null = 2 x lora_rank (a scale "
            "of 2 at any rank, the common recipe's choice)",
        },
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={"sets": "lora.dropout", "help": "dropout on the adapters' input in training"},
    )
    lora_modules: List[one_of(*FP8_MODULES, checked_by=VLMConfig.validate)] = field(
        default_factory=lambda: ["attn"],
        metadata={
            "sets": "lora.modules",
            "help": "where adapters go: attn (decoder q/k/v/o; Gated DeltaNet in_proj_qkv, in_proj_z, "
            "out_proj), mlp (dense MLPs, the shared expert), experts (each routed expert's gate/up and down, "
            "through the grouped GEMM), vision (vision blocks and mergers)",
        },
    )
    lora_router: one_of(*LORA_ROUTER, checked_by=VLMConfig.validate) = field(
        default="frozen",
        metadata={
            "sets": "lora.router",
            "help": "with LoRA: the MoE routers stay frozen, or are trained full-rank",
        },
    )
    cuda_graph_scope: List[one_of(*GRAPH_SCOPES, checked_by=scope_problem)] = field(
        default_factory=list,
        metadata={
            "help": "decoder-layer regions captured as CUDA graphs at the first training step and replayed "
            "(moevlm.parallel.cuda_graphs): any of attn (norm, q/k/v, rope, sdpa, o_proj; needs "
            "attn_backend=sdpa), moe_router, moe_preprocess (the dispatcher's sort/counts before any "
            "exchange), or full_layer alone (the whole layer; local dispatcher only); [] = none. CUDA only"
        },
    )


def model_fields(m: ModelConfig | None = None) -> dict[str, str]:
    """`model.<key>` -> the VLMConfig field it is: every `sets` field, and the `edits` fields (proxies)
    that `m` sets (all of them when `m` is None)."""
    out = {}
    for f in dataclasses.fields(ModelConfig):
        path = f.metadata.get("sets") or f.metadata.get("edits")
        if path and ("sets" in f.metadata or m is None or getattr(m, f.name) is not None):
            out[f.name] = path
    return out


def model_config(m: ModelConfig) -> VLMConfig:
    """The model config `m` composes: the preset or HF config, then every declared field of `m`
    (`model_fields`) assigned by path, validated; a ConfigError speaks the job's keys."""
    _check_proxies(m)
    cfg = _hf_config(m.hf_config) if m.hf_config else VLMConfig.preset(_preset_of(m))
    _check_family(m, cfg)
    for key, path in model_fields(m).items():
        _assign(cfg, path, getattr(m, key))
    if m.num_layers is not None:  # dense layers and deepstack taps beyond a shrunk depth go with it
        cfg.moe.mlp_only_layers = tuple(i for i in cfg.moe.mlp_only_layers if i < m.num_layers)
        cfg.text.layer_types = layer_types_for(cfg.text.layer_types, m.num_layers)
    if m.vision_depth is not None and m.vision_taps is None:
        cfg.vision.deepstack_visual_indexes = tuple(
            i for i in cfg.vision.deepstack_visual_indexes if i < m.vision_depth
        )
    try:
        return cfg.validate()
    except ConfigError as err:
        raise ConfigError(in_job_keys(str(err), m)) from None


# each family's CPU-size preset, which model.family picks with the default model.preset
FAMILY_TINY = {"qwen3_vl_moe": "tiny", "qwen3_5_moe": "qwen3_5_tiny"}


def _preset_of(m: ModelConfig) -> str:
    """model.preset, or model.family's tiny preset where the preset is the default one."""
    if m.preset == ModelConfig.preset:
        return FAMILY_TINY.get(m.family, m.preset)  # a value not allowed: the field's check says so
    return m.preset


def _check_family(m: ModelConfig, cfg: VLMConfig) -> None:
    source = (
        f"model.hf_config={shown_path(m.hf_config)}" if m.hf_config else f"model.preset={m.preset}"
    )
    check(
        m.family not in FAMILY_TINY or m.family == cfg.family,
        f"model.family={m.family} but {source} is a {cfg.family} model; drop model.family or pick "
        f"a {m.family} architecture (presets: "
        + ", ".join(n for n in PRESET_NAMES if VLMConfig.preset(n).family == m.family)
        + ")",
    )


def layer_types_for(layer_types: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """A hybrid model's per-layer kinds for `num_layers` layers: its own cut, or repeated in order."""
    n = len(layer_types)
    return tuple(layer_types[i % n] for i in range(num_layers)) if n else ()


def _hf_config(path: str) -> VLMConfig:
    """model.hf_config read, or a ConfigError saying why not (missing, not JSON, not the model's keys)."""
    key = f"model.hf_config={shown_path(path)}"
    check(os.path.exists(path), f"{key} does not exist; give an HF config.json or its folder")
    try:
        return VLMConfig.from_hf(path)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{key} cannot be read as a Qwen3-VL-MoE or Qwen3.5-MoE config.json ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None


def in_job_keys(message: str, m: ModelConfig) -> str:
    """`message` (from VLMConfig.validate) with each `path=value` a job field set written `model.<key>=value`."""
    for key, path in model_fields(m).items():
        message = re.sub(rf"(?<![\w.]){re.escape(path)}=", f"model.{key}=", message)
    return message


def _assign(cfg: VLMConfig, path: str, value) -> None:
    *parents, name = path.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    setattr(node, name, tuple(value) if isinstance(value, list) else value)


def _check_proxies(m: ModelConfig) -> None:
    """The proxy sizes, before they edit the architecture (0 experts is a proxy's own meaning: dense)."""
    for name, least, what in (
        ("num_layers", 1, ""),
        ("vision_depth", 1, ""),
        ("num_experts", 0, " (0: a dense MLP in every layer)"),
    ):
        value = getattr(m, name)
        check(
            value is None or is_int(value) and value >= least,
            f"model.{name}={value!r} must be an integer >= {least}{what}, or null for the model's own",
        )
    taps = m.vision_taps
    check(
        taps is None or all(is_int(i) and i >= 0 for i in taps) and list(taps) == sorted(set(taps)),
        f"model.vision_taps={taps!r} must be vision block indexes in increasing order, or null for the "
        "model's own",
    )


def spec_fields() -> dict[str, str]:
    """`model.<key>` -> the DispatcherSpec field it sets."""
    return {
        f.name: f.metadata["spec"] for f in dataclasses.fields(ModelConfig) if "spec" in f.metadata
    }
