"""Hugging Face Qwen3-VL-MoE and Qwen3.5-MoE checkpoints in and out: whole tensors and files only.

Reads a folder with `config.json` and `model.safetensors` or a sharded
`model.safetensors.index.json`; writes the same.

    model = load_pretrained(Qwen3VLMoe, hf_dir, expert_layout="auto")   # headers checked first
    save_pretrained(model, out_dir, expert_layout="hub")     # or "hf": transformers' own layout

Expert layouts: Qwen3-VL's hub `gate_up_proj` (E, D, 2F) / `down_proj` (E, F, D) (ours);
transformers' (E, 2F, D) / (E, D, F); Qwen3.5's hub, one `experts.<e>.{gate,up,down}_proj.weight`
per expert ((F, D), (F, D), (D, F)), read whatever `expert_layout` says and written as "hub" for a
Qwen3.5 model. A Gated DeltaNet's in_proj_qkv rows and conv channels are ours grouped by key head
(`gated_deltanet.qkv_order`), the reference's [q | k | v]: permuted in and out. The `mtp.*` tensors
of Qwen3.5 checkpoints (multi-token prediction) are not read.
Sharded or pipeline-split models: moevlm.parallel.hf_io.
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moevlm.model.config import VLMConfig
from moevlm.model.gated_deltanet import qkv_order
from moevlm.model.hf_config import FAMILIES
from moevlm.model.moe import is_training_state

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
# one expert's matrix of a Qwen3.5 checkpoint: (our fused tensor's prefix, expert, which)
_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_NOT_READ = ("mtp.",)  # Qwen3.5's multi-token-prediction head: transformers skips it too
BY_KEY_HEAD = (".linear_attn.in_proj_qkv.weight", ".linear_attn.conv1d.weight")


class CheckpointError(ValueError):
    """A checkpoint does not match the model; the message lists every mismatch."""


def hf_to_ours(name: str) -> str:
    return _rename(name, src=0, dst=1)


def ours_to_hf(name: str) -> str:
    return _rename(name, src=1, dst=0)


def _rename(name: str, src: int, dst: int) -> str:
    for pair in _PREFIXES:
        if name.startswith(pair[src]):
            name = pair[dst] + name[len(pair[src]) :]
            break
    if name.endswith(_ROUTER[src]):
        name = name[: -len(_ROUTER[src])] + _ROUTER[dst]
    return name


def _is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def key_head_order(cfg: VLMConfig | None) -> torch.Tensor:
    """The reference's row at each of ours in a Gated DeltaNet's in_proj_qkv and conv1d."""
    if cfg is None:
        raise ValueError(
            "a Gated DeltaNet's in_proj_qkv and conv1d are permuted on loading: pass the model's "
            "config to match_checkpoint(..., config=model.config)"
        )
    t = cfg.text
    return qkv_order(
        t.linear_num_key_heads,
        t.linear_num_value_heads,
        t.linear_key_head_dim,
        t.linear_value_head_dim,
    )


# ---------------------------------------------------------------------- load
def checkpoint_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [hf_dir / f for f in sorted(set(weight_map.values()))]
    single = hf_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(
        f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json"
    )


# bytes per element of the safetensors dtypes; the library's own bound on a header's length
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
_DTYPE_BYTES |= {"I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100_000_000


def safetensors_problem(path: Path) -> str | None:
    """What makes `path` unreadable as a safetensors file, from its header alone (a length word, a JSON
    header, each tensor's byte range and size against the file's), or None: a truncated download or an
    absurd header is found here, before the model is built.  The weights themselves are not read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else None
            if n is None or n > MAX_HEADER_BYTES or 8 + n > size:
                return (
                    f"{size} bytes, too short for a safetensors header (truncated?)"
                    if n is None
                    else f"its header claims {n:,} bytes (the file has {size:,}): not a safetensors "
                    "file, or truncated"
                )
            header = json.loads(f.read(n))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not JSON: not a safetensors file, or damaged"
    if not isinstance(header, dict):
        return "its header is not a JSON object: not a safetensors file"
    data, end = size - 8 - n, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            (b, e), shape, dtype = t["data_offsets"], t["shape"], t["dtype"]
            count = 1
            for d in shape:
                count *= int(d)
            ok = 0 <= int(b) <= int(e) and all(int(d) >= 0 for d in shape)
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets in the header"
        b, e = int(b), int(e)
        want = count * _DTYPE_BYTES[dtype] if dtype in _DTYPE_BYTES else e - b
        if not ok or e - b != want:
            return (
                f"tensor {name!r}: shape {shape} {dtype} does not match its byte range [{b}, {e})"
            )
        end = max(end, e)
    if end > data:
        return f"its tensors need {end:,} bytes of data, the file holds {data:,} (truncated)"
    return None


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple]:
    """Our tensor names and (global) shapes that a checkpoint must provide (a tied head is the embedding)."""
    expected = {
        k: tuple(v.shape) for k, v in model.state_dict().items() if not is_training_state(k)
    }
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def match_checkpoint(
    expected: dict[str, tuple],
    files: list[Path],
    expert_layout: str = "auto",
    *,
    tie_word_embeddings: bool = False,
    config: VLMConfig | None = None,
) -> dict[str, tuple]:
    """Map each of our tensor `expected` names (`expected_shapes`) to (sources, transform): the
    checkpoint's (file, hf name) pairs it is made of and how; from headers only; raise
    CheckpointError listing all mismatches.  `config`: the model's, needed for Gated DeltaNet layers."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; choose one of {EXPERT_LAYOUTS}")
    plan, pieces, seen = {}, {}, set()
    bad = {"missing": [], "unexpected": [], "misshaped": [], "not_float": []}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            file_layout = (f.metadata() or {}).get(_LAYOUT_KEY)
            for hf_name in f.keys():
                ours = hf_to_ours(hf_name)
                if hf_name.startswith(_NOT_READ) or (
                    ours == "lm_head.weight" and tie_word_embeddings
                ):
                    continue  # tied: the embedding is the head; a stored copy is redundant
                piece = _PER_EXPERT.match(ours)
                if ours not in expected and not piece:
                    bad["unexpected"].append(hf_name)
                    continue
                seen.add(ours)
                header = f.get_slice(hf_name)
                shape, dtype = tuple(header.get_shape()), header.get_dtype()
                if not is_floating(dtype):
                    bad["not_float"].append(f"{hf_name}: {dtype} in {path}")
                elif piece:
                    pieces.setdefault(piece[1], {})[piece[3], int(piece[2])] = (
                        path,
                        hf_name,
                        shape,
                    )
                elif t := _transform_for(ours, shape, expected[ours], expert_layout, file_layout):
                    if ours.endswith(BY_KEY_HEAD):
                        t = ("rows", key_head_order(config))
                    plan[ours] = (((path, hf_name),), t)
                else:
                    want = _hf_shape(ours, expected[ours])
                    bad["misshaped"].append(f"{hf_name}: checkpoint {shape}, model expects {want}")
    seen |= _plan_per_expert(pieces, expected, plan, bad)
    bad["missing"] += [ours_to_hf(k) for k in expected if k not in seen]
    if any(bad.values()):
        raise CheckpointError(_mismatch_report(*bad.values()))
    return plan


def _plan_per_expert(pieces: dict, expected: dict, plan: dict, bad: dict) -> set[str]:
    """Plan our fused expert tensors from a checkpoint's per-expert matrices (Qwen3.5's hub form):
    gate_up_proj (E, D, 2F) from E gate and E up (F, D); down_proj (E, F, D) from E down (D, F).
    Returns the names of ours the pieces stand for."""
    seen = set()
    for prefix, got in pieces.items():
        for ours in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
            kinds = _pieces_of(ours)[1]
            mine = {k: v for k, v in got.items() if k[0] in kinds}
            if not mine:
                continue
            if ours not in expected:
                bad["unexpected"] += [v[1] for v in mine.values()]
                continue
            seen.add(ours)
            E, a, b = expected[ours]
            one = (b // 2, a) if kinds[0] == "gate_proj" else (b, a)  # (F, D) / (D, F)
            need = [(k, e) for e in range(E) for k in kinds]
            bad["missing"] += [_expert_name(prefix, k, e) for k, e in need if (k, e) not in mine]
            bad["unexpected"] += [v[1] for k, v in mine.items() if k not in need]
            wrong = [v for v in mine.values() if v[2] != one]
            bad["misshaped"] += [f"{v[1]}: checkpoint {v[2]}, model expects {one}" for v in wrong]
            if all(k in mine for k in need) and not wrong:
                plan[ours] = (tuple(mine[k][:2] for k in need), f"experts_{len(kinds)}")
    return seen


def _expert_name(prefix: str, kind: str, e: int) -> str:
    return ours_to_hf(f"{prefix}.{e}.{kind}.weight")


def is_floating(safetensors_dtype: str) -> bool:
    """A safetensors header dtype ("F32", "BF16", "F8_E4M3", ...; integers are "I32", "U8", "BOOL")
    that holds real numbers: only those may become our (floating-point) weights."""
    return safetensors_dtype.startswith("F") or safetensors_dtype == "BF16"


def _transform_for(ours: str, shape, want, expert_layout: str, file_layout: str | None):
    """'copy', 'transpose' or 'flatten' to turn a checkpoint tensor into ours, or None."""
    if ours == "vision.patch_embed.weight":
        return (
            "flatten"
            if len(shape) == 5 and (shape[0], int(torch.Size(shape[1:]).numel())) == want
            else None
        )
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
    raise CheckpointError(
        f"{ours} is square, so its layout cannot be told from its shape: pass "
        "expert_layout='hub' (published checkpoints: (E, D, 2F)/(E, F, D)) or 'hf' "
        "(transformers >= 5 saves: (E, 2F, D)/(E, D, F))"
    )


def _hf_shape(ours: str, want) -> tuple:
    return want if ours != "vision.patch_embed.weight" else (want[0], "C*T*P*P=" + str(want[1]))


def _mismatch_report(missing, unexpected, misshaped, not_float=(), limit: int = 20) -> str:
    lines = ["checkpoint does not match the model configuration:"]
    for title, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("wrong shape", misshaped),
        (
            "not floating point (integer or bool data cast to weights would train nonsense; "
            "re-export the checkpoint)",
            not_float,
        ),
    ):
        if items:
            lines.append(
                f"  {len(items)} {title}: "
                + ", ".join(items[:limit])
                + (" ..." if len(items) > limit else "")
            )
    return "\n".join(lines)


def _apply(transform: str, ts: list[torch.Tensor], want_shape) -> torch.Tensor:
    if transform == "experts_2":  # gate_0, up_0, gate_1, up_1, ...: (E, 2F, D) -> ours
        return torch.stack([torch.cat(ts[i : i + 2]) for i in range(0, len(ts), 2)]).transpose(1, 2)
    if transform == "experts_1":  # down_0, down_1, ...: (E, D, F) -> ours
        return torch.stack(ts).transpose(1, 2)
    (t,) = ts
    if isinstance(transform, tuple):  # ("rows", the source row of each of ours)
        return t[transform[1]]
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
    plan = match_checkpoint(
        expected_shapes(model),
        checkpoint_files(hf_dir),
        expert_layout,
        tie_word_embeddings=config.tie_word_embeddings,
        config=config,
    )
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.text.embed_tokens.weight
    _copy_weights(model, plan)
    return model


def check_architecture(hf_dir: Path, mine: VLMConfig) -> None:
    """The checkpoint's architecture must be the model's (weights are copied by name and shape)."""
    theirs = VLMConfig.from_hf(Path(hf_dir) / "config.json")
    if theirs.family != mine.family:
        raise CheckpointError(
            f"{hf_dir} holds a {FAMILIES[theirs.family]} checkpoint (model_type {theirs.family}), the "
            f"configured model is {FAMILIES[mine.family]}; build the model from its config.json "
            "(model.hf_config) or pick a preset of its family"
        )
    if diff := architecture_differences(theirs, mine):
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise CheckpointError(
            f"{hf_dir} holds a different architecture than the configured model; build the "
            f"model from its config.json (model.hf_config) or pick the matching preset ({shown})"
        )


def architecture_differences(theirs: VLMConfig, mine: VLMConfig) -> list[str]:
    """`section.field: checkpoint X, configured Y` for each field that decides the weights' names and
    shapes (the vision and text configs, the routed and shared experts) and differs."""
    out = []
    for section in ("vision", "text"):
        a, b = getattr(theirs, section), getattr(mine, section)
        for f in dataclasses.fields(a):
            if (x := getattr(a, f.name)) != (y := getattr(b, f.name)):
                out.append(f"{section}.{f.name}: checkpoint {x}, configured {y}")
    for name in ("num_experts", "top_k", "shared_expert_intermediate_size"):
        if (x := getattr(theirs.moe, name)) != (y := getattr(mine.moe, name)):
            out.append(f"moe.{name}: checkpoint {x}, configured {y}")
    return out


def read_tensors(plan: dict[str, tuple], names, shapes: dict[str, tuple]):
    """(our name, tensor in our layout) for `names` of a `match_checkpoint` plan, file by file."""
    with ExitStack() as files:
        opened = {}

        def read(path: Path, hf_name: str) -> torch.Tensor:
            if path not in opened:
                opened[path] = files.enter_context(safe_open(str(path), framework="pt"))
            t = opened[path].get_tensor(hf_name)
            # match_checkpoint refuses these from the headers; a file changed since
            if not t.is_floating_point():
                raise CheckpointError(
                    f"{hf_name} in {path} is {t.dtype}, not floating point; a weight must "
                    "be stored as a float (F32, BF16, F16, F8)"
                )
            if not _finite(t):  # NaN or inf in a source: no update made it so
                raise CheckpointError(
                    f"non-finite values in {path}:{hf_name} (NaN or inf in the stored weights): "
                    "the checkpoint is damaged; re-download or re-export it"
                )
            return t

        for ours in sorted(names, key=lambda n: str(plan[n][0][0][0])):
            sources, transform = plan[ours]
            yield ours, _apply(transform, [read(*s) for s in sources], shapes[ours])


def _finite(t: torch.Tensor) -> bool:
    """Every value of `t` finite (FP8 kinds, which torch's isfinite lacks, are read as FP16)."""
    return bool(torch.isfinite(t.to(torch.float16) if t.element_size() == 1 else t).all())


def _copy_weights(model: torch.nn.Module, plan: dict[str, tuple]) -> None:
    params = model.state_dict()
    with torch.no_grad():
        for ours, t in read_tensors(plan, plan, {k: v.shape for k, v in params.items()}):
            params[ours].copy_(t)


# -------------------------------------------------------------------- export
def to_hf(
    name: str, t: torch.Tensor, cfg: VLMConfig, expert_layout: str = "hub"
) -> dict[str, torch.Tensor]:
    """One of our (whole, unsharded) tensors as the reference names and stores it: one tensor, or a
    Qwen3.5 model's experts one matrix per expert (`expert_layout` "hub")."""
    if expert_layout not in ("hub", "hf"):
        raise ValueError(f"export expert_layout={expert_layout!r}; choose 'hub' or 'hf'")
    if name == "vision.patch_embed.weight":
        v = cfg.vision
        t = t.reshape(t.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    elif _is_expert(name) and expert_layout == "hf":
        t = t.transpose(1, 2)
    elif _is_expert(name) and per_expert(cfg, expert_layout):
        return _per_expert_tensors(name, t)
    elif name.endswith(BY_KEY_HEAD):
        t = t[key_head_order(cfg).argsort().to(t.device)]
    return {ours_to_hf(name): t.contiguous().cpu()}


def per_expert(cfg: VLMConfig, expert_layout: str) -> bool:
    """Whether experts are written one matrix per expert: Qwen3.5's hub form."""
    return cfg.family == "qwen3_5_moe" and expert_layout == "hub"


def hf_names(name: str, cfg: VLMConfig, expert_layout: str = "hub") -> list[str]:
    """The reference's names `to_hf` writes our tensor `name` under (for an index, without data)."""
    if not (_is_expert(name) and per_expert(cfg, expert_layout)):
        return [ours_to_hf(name)]
    prefix, kinds = _pieces_of(name)
    return [_expert_name(prefix, k, e) for e in range(cfg.moe.num_experts) for k in kinds]


def _pieces_of(name: str) -> tuple[str, tuple[str, ...]]:
    """(prefix, the per-expert matrices) of our fused expert tensor `name`."""
    prefix, _, which = name.rpartition(".")
    return prefix, ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)


def _per_expert_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix, kinds = _pieces_of(name)
    out = {}
    for e, w in enumerate(t.transpose(1, 2).cpu()):  # (2F, D) or (D, F)
        parts = w.chunk(len(kinds))
        out |= {_expert_name(prefix, k, e): p.contiguous() for k, p in zip(kinds, parts)}
    return out


def export_state_dict(
    model: torch.nn.Module, expert_layout: str = "hub"
) -> dict[str, torch.Tensor]:
    """A whole (unsharded) model's tensors under the reference's names.  A model laid out by
    `moevlm.parallel` is exported with `moevlm.parallel.save_hf` (it gathers the shards)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings or is_training_state(name):
            continue
        if type(t) is not torch.Tensor:
            raise TypeError(
                f"{name} is a {type(t).__name__} (a sharded model): export it with "
                "moevlm.parallel.save_hf(model, out_dir), which gathers the shards"
            )
        out |= to_hf(name, t.detach(), model.config, expert_layout)
    return out


def shard_names(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most max_shard_bytes (a larger tensor gets a file)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def file_names(n: int) -> list[str]:
    return (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )


def write_file(path: Path, tensors: dict[str, torch.Tensor], expert_layout: str) -> None:
    save_file(tensors, str(path), metadata={"format": "pt", _LAYOUT_KEY: expert_layout})


def write_index_and_config(
    out_dir: Path, weight_map: dict[str, str], total_size: int, cfg: VLMConfig, dtype: torch.dtype
) -> None:
    """config.json, and the index when the weights span several files."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(
        json.dumps(cfg.to_hf(str(dtype).removeprefix("torch.")), indent=2)
    )


def save_pretrained(
    model, out_dir, *, expert_layout: str = "hub", max_shard_bytes: int = 5 << 30
) -> None:
    """Write a whole model as a Hugging Face folder (sharded models: `moevlm.parallel.save_hf`)."""
    tensors = export_state_dict(model, expert_layout)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = shard_names(
        {k: t.numel() * t.element_size() for k, t in tensors.items()}, max_shard_bytes
    )
    weight_map = {}
    for fname, names in zip(file_names(len(groups)), groups):
        write_file(out_dir / fname, {k: tensors[k] for k in names}, expert_layout)
        weight_map.update({k: fname for k in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_index_and_config(
        out_dir, weight_map, total, model.config, next(iter(tensors.values())).dtype
    )
