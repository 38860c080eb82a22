"""Hugging Face Qwen3-VL-MoE checkpoints in and out.

Reads a folder with `config.json` and `model.safetensors` or a sharded
`model.safetensors.index.json`; writes the same.

Design choices:
- Names: one table of prefixes (`_PREFIXES`) and the router suffix, read
  forwards on load and backwards on export.  Our module tree keeps the
  reference's names except the top-level prefixes, the router (`mlp.router`),
  the deepstack list and the patch embedding (a linear weight instead of a
  Conv3d kernel).
- Expert layouts: hub checkpoints store `gate_up_proj` (E, D, 2F) and
  `down_proj` (E, F, D) (our layout); transformers >= 5 keeps and saves
  (E, 2F, D) / (E, D, F).  `expert_layout="auto"` decides by shape; when the
  shapes are square (D == 2F or D == F) it uses the layout recorded in the
  file's metadata by our exporter, and otherwise asks the caller to say which.
- Everything is checked from the safetensors headers (names and shapes only)
  before any parameter is allocated; one error lists every missing,
  unexpected and mis-shaped tensor.
- Export writes the hub layout by default (what the published checkpoints and
  other tools read), `expert_layout="hf"` writes transformers' own.
- Loading streams tensor by tensor into a model materialised from the meta
  device; default dtype is the torch default (fp32 master weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moevlm.model.config import VLMConfig

# (reference prefix, our prefix), most specific first; used in both directions.
_PREFIXES = [
    ("model.visual.patch_embed.proj.", "vision.patch_embed."),
    ("model.visual.deepstack_merger_list.", "vision.deepstack_mergers."),
    ("model.visual.", "vision."),
    ("model.language_model.", "text."),
]
_ROUTER = (".mlp.gate.weight", ".mlp.router.weight")  # (reference suffix, ours)
EXPERT_LAYOUTS = ("auto", "hub", "hf")
_LAYOUT_KEY = "moevlm_expert_layout"


class CheckpointError(ValueError):
    """A checkpoint does not match the model; the message lists every mismatch."""


def hf_to_ours(name: str) -> str:
    return _rename(name, src=0, dst=1)


def ours_to_hf(name: str) -> str:
    return _rename(name, src=1, dst=0)


def _rename(name: str, src: int, dst: int) -> str:
    for pair in _PREFIXES:
        if name.startswith(pair[src]):
            name = pair[dst] + name[len(pair[src]):]
            break
    if name.endswith(_ROUTER[src]):
        name = name[: -len(_ROUTER[src])] + _ROUTER[dst]
    return name


def _is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


# ---------------------------------------------------------------------- load
def checkpoint_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [hf_dir / f for f in sorted(set(weight_map.values()))]
    single = hf_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")


def plan_load(model: torch.nn.Module, files: list[Path], expert_layout: str = "auto") -> dict[str, tuple]:
    """Map every checkpoint tensor to (file, hf name, transform) of our parameter,
    from headers only; raise CheckpointError listing all mismatches."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; choose one of {EXPERT_LAYOUTS}")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    plan, seen, unexpected, misshaped = {}, set(), [], []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            file_layout = (f.metadata() or {}).get(_LAYOUT_KEY)
            for hf_name in f.keys():
                ours = hf_to_ours(hf_name)
                if ours == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # tied: the embedding is the head; a stored copy is redundant
                if ours not in expected:
                    unexpected.append(hf_name)
                    continue
                seen.add(ours)
                shape = tuple(f.get_slice(hf_name).get_shape())
                transform = _transform_for(ours, shape, expected[ours], expert_layout, file_layout)
                if transform is None:
                    misshaped.append(f"{hf_name}: checkpoint {shape}, model expects {_hf_shape(ours, expected[ours])}")
                else:
                    plan[ours] = (path, hf_name, transform)
    missing = [ours_to_hf(k) for k in expected if k not in seen]
    if missing or unexpected or misshaped:
        raise CheckpointError(_mismatch_report(missing, unexpected, misshaped))
    return plan


def _transform_for(ours: str, shape, want, expert_layout: str, file_layout: str | None):
    """'copy', 'transpose' or 'flatten' to turn a checkpoint tensor into ours, or None."""
    if ours == "vision.patch_embed.weight":
        return "flatten" if len(shape) == 5 and (shape[0], int(torch.Size(shape[1:]).numel())) == want else None
    if not _is_expert(ours):
        return "copy" if shape == want else None
    transposed = (want[0], want[2], want[1])
    fits = {"hub": shape == want, "hf": shape == transposed}
    layout = expert_layout
    if layout == "auto":
        if fits["hub"] and fits["hf"]:
            layout = file_layout or _ambiguous(ours)
        else:
            layout = "hub" if fits["hub"] else "hf"
    if not fits[layout]:
        return None
    return "copy" if layout == "hub" else "transpose"


def _ambiguous(ours: str):
    raise CheckpointError(f"{ours} is square, so its layout cannot be told from its shape: pass "
                          "expert_layout='hub' (published checkpoints: (E, D, 2F)/(E, F, D)) or 'hf' "
                          "(transformers >= 5 saves: (E, 2F, D)/(E, D, F))")


def _hf_shape(ours: str, want) -> tuple:
    return want if ours != "vision.patch_embed.weight" else (want[0], "C*T*P*P=" + str(want[1]))


def _mismatch_report(missing, unexpected, misshaped, limit: int = 20) -> str:
    lines = ["checkpoint does not match the model configuration:"]
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if items:
            lines.append(f"  {len(items)} {title}: " + ", ".join(items[:limit]) + (" ..." if len(items) > limit else ""))
    return "\n".join(lines)


def _apply(transform: str, t: torch.Tensor, want_shape) -> torch.Tensor:
    if transform == "transpose":
        return t.transpose(1, 2)
    if transform == "flatten":
        return t.reshape(want_shape)
    return t


def load_pretrained(cls, hf_dir, *, device="cpu", dtype=None, expert_layout="auto", **overrides):
    hf_dir = Path(hf_dir)
    config = VLMConfig.from_hf(hf_dir / "config.json")
    if overrides:
        config = config.replace(**overrides).validate()
    with torch.device("meta"):
        model = cls(config)
    plan = plan_load(model, checkpoint_files(hf_dir), expert_layout)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.text.embed_tokens.weight
    _copy_weights(model, plan)
    return model


def load_weights_(model: torch.nn.Module, hf_dir, expert_layout: str = "auto") -> None:
    """Copy an HF checkpoint's weights into an already materialised model (in place).
    The checkpoint's architecture must be the model's (checked: names and shapes)."""
    hf_dir = Path(hf_dir)
    theirs = VLMConfig.from_hf(hf_dir / "config.json")
    mine = model.config
    if (theirs.vision, theirs.text, theirs.moe.num_experts, theirs.moe.top_k) != (
            mine.vision, mine.text, mine.moe.num_experts, mine.moe.top_k):
        raise CheckpointError(f"{hf_dir} holds a different architecture than the configured model; build the "
                              "model from its config.json (model.hf_config) or pick the matching preset")
    _copy_weights(model, plan_load(model, checkpoint_files(hf_dir), expert_layout))


def _copy_weights(model: torch.nn.Module, plan: dict[str, tuple]) -> None:
    params = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for ours, (path, _, _) in plan.items():
        by_file.setdefault(path, []).append(ours)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for ours in names:
                    _, hf_name, transform = plan[ours]
                    _assign(params[ours], _apply(transform, f.get_tensor(hf_name), params[ours].shape))


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter; a sharded (DTensor) parameter keeps its shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from moevlm.parallel.parallelize import copy_full_

        copy_full_(param, full)
    else:
        param.copy_(full)


# -------------------------------------------------------------------- export
def export_state_dict(model: torch.nn.Module, expert_layout: str = "hub") -> dict[str, torch.Tensor]:
    if expert_layout not in ("hub", "hf"):
        raise ValueError(f"export expert_layout={expert_layout!r}; choose 'hub' or 'hf'")
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = t.detach()
        if isinstance(t, DTensor):  # a sharded model: gathered on every rank (collective)
            from moevlm.parallel.parallelize import full_tensor

            t = full_tensor(t, name)
        if name == "vision.patch_embed.weight":
            v = model.config.vision
            t = t.reshape(t.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        elif _is_expert(name) and expert_layout == "hf":
            t = t.transpose(1, 2)
        out[ours_to_hf(name)] = t.contiguous().cpu()
    return out


def save_pretrained(model, out_dir, *, expert_layout: str = "hub", max_shard_bytes: int = 5 << 30) -> None:
    """Under a parallel layout every rank must call this (the weights are gathered);
    global rank 0 writes."""
    import torch.distributed as dist

    tensors = export_state_dict(model, expert_layout)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", _LAYOUT_KEY: expert_layout}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata=meta)
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2))
