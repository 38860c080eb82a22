"""The job's schema: one dataclass per config group, registered in Hydra's ConfigStore and filled by
the YAML groups in `conf/` and the command line; every option it has, and the refusal of one it lacks.

    job = compose_job(["+experiment=h100_fsdp", "data.shards=DIR"])   # what train.py composes
    [o.path for o in options()]                                      # model.preset, ..., train.profile_steps
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import pickle
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore

from moevlm.config.model_section import ModelConfig, model_fields
from moevlm.config.sections import OptimConfig, ParallelConfig, TrainConfig
from moevlm.data.config import DataConfig
from moevlm.errors import ConfigError
from moevlm.fields import allowed

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf")


@dataclass
class JobConfig:
    """The whole job, one section per config group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def register_schema() -> None:
    """The schema behind conf/config.yaml (its first default): every group file and override is
    checked against these types.  Once per process: storing converts the dataclass tree again
    (a fifth of a compose)."""
    store = ConfigStore.instance()
    if "job_schema.yaml" not in store.repo:
        store.store(name="job_schema", node=JobConfig)


def compose_job(overrides: list[str] = (), config_dir: str | None = None):
    """The job config as `train.py` would compose it (for notebooks and tests).  Unlike the command
    line, a list built in code may give a key again to change it: the last value wins, as in Hydra.
    Each call returns its own copy.  With the package's own `conf/`, the config groups' composition
    is kept per choice of groups and plain `section.field=value` overrides are applied to a copy of
    it, by Hydra's own parser and override step (what Hydra does after composing: they never change
    which files compose); any other override list composes whole."""
    key = None if config_dir is not None else tuple(overrides)
    if key in _COMPOSED:
        return pickle.loads(_COMPOSED[key])
    register_schema()
    check_overrides(overrides, repeats=False)
    split = _groups_and_values(overrides) if key is not None else None
    try:
        job = None if split is None else _compose_split(*split)
    except Exception:  # a mistake: Hydra's own error, from composing the whole list
        job = None
    if job is None:
        job = _compose(overrides, config_dir)
    if key is not None:
        _remember(key, job)
    return job


def _compose(overrides, config_dir: str | None):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.abspath(config_dir or CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def _remember(key: tuple, job) -> None:
    """Keeps `job` pickled: a copy is one unpickling (a fifth of a deep copy)."""
    if len(_COMPOSED) >= 256:
        _COMPOSED.pop(next(iter(_COMPOSED)))
    _COMPOSED[key] = pickle.dumps(job)


def _groups_and_values(overrides) -> tuple[tuple, list] | None:
    """(the group choices, the plain `section.field=value` overrides), or None where the list holds
    anything else (a `+`/`~` edit of a field, hydra.*, a whole section): Hydra applies field overrides
    after the groups compose, in their order, so only a list of these two kinds splits."""
    groups, values = [], []
    for item in map(str, overrides):
        name, eq, value = item.partition("=")
        if not eq:
            return None
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name) and name.split(".")[0] != "hydra":
            values.append(item)
        elif re.fullmatch(r"\+{0,2}[A-Za-z_][\w/]*", name) and not value.startswith(("{", "[")):
            group = name.lstrip("+")
            if not (group.startswith("hydra/") or os.path.isdir(os.path.join(CONF, group))):
                return None
            groups.append(item)
        else:
            return None
    return tuple(groups), values


def _compose_split(groups: tuple, values: list[str]):
    """The groups' composition (kept) with `values` applied to a copy; None for a sweep."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    new = [v for v in dict.fromkeys(values) if v not in _PARSED]
    for item, parsed in zip(new, OverridesParser.create().parse_overrides(new) if new else ()):
        if len(_PARSED) >= 4096:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[item] = parsed
    parsed = [_PARSED[v] for v in values]
    if any(o.is_sweep_override() for o in parsed):
        return None
    if groups not in _COMPOSED:
        _remember(groups, _compose(groups, None))
    job = pickle.loads(_COMPOSED[groups])
    ConfigLoaderImpl._apply_overrides_to_config(parsed, job)
    return job


_COMPOSED: dict = {}  # override tuple -> the composed job, pickled (compose_job's copies)
_PARSED: dict = {}  # override -> Hydra's parse of it (Override objects are only read)


# ------------------------------------------------------------------ the options
class Option(NamedTuple):
    path: str  # section.field, as written on the command line
    type: str
    default: Any
    allowed: tuple[str, ...]  # empty: any value of the type
    help: str


def sections(cls: type = JobConfig, prefix: str = "") -> Iterator[tuple[str, str, list[Option]]]:
    """(section path, its description, its leaf options) for every dataclass under `cls`, depth first."""
    values, hints = allowed(cls), get_type_hints(cls)
    leaves, nested = [], []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((path, hints[f.name]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        leaves.append(
            Option(
                path,
                _type_name(hints[f.name]),
                default,
                values.get(f.name, ()),
                _help(f.metadata),
            )
        )
    if prefix:
        yield prefix.rstrip("."), _doc(cls), leaves
    for path, sub in nested:
        yield from sections(sub, f"{path}.")


def options(cls: type = JobConfig) -> list[Option]:
    return [o for _, _, opts in sections(cls) for o in opts]


def missing_help(cls: type = JobConfig) -> list[str]:
    """Paths of the leaf fields without a description, and of the sections without a docstring."""
    missing = [o.path for o in options(cls) if not o.help.strip()]
    return missing + [path for path, doc, _ in sections(cls) if not doc]


def _help(metadata) -> str:
    """The field's description, and the model-config or dispatcher-spec field it sets."""
    text = metadata.get("help", "")
    if text and "sets" in metadata:
        return f"{text} [VLMConfig.{metadata['sets']}]"
    if text and "edits" in metadata:
        return f"{text} [VLMConfig.{metadata['edits']} when not null]"
    if text and "spec" in metadata:
        return f"{text} [DispatcherSpec.{metadata['spec']}]"
    return text


def _doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    # dataclass's generated repr
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def _type_name(tp) -> str:
    if tp is Any:
        return "any"
    args = get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named + ["null"] * (len(named) < len(args)))
    if get_origin(tp) in (tuple, list):
        return f"[{', '.join(_type_name(a) for a in args)}]"
    return tp.__name__


# ------------------------------------------------------------------ unknown keys
# the names users bring from other trainers (HF Trainer, torchtitan, Megatron, NeMo), under any section:
# their option here (difflib's nearest names miss them: `learning_rate` is nearer `min_lr_ratio` than `lr`)
FOREIGN_NAMES: dict[str, list[str]] = {
    "lr": ["optim.lr"],
    "learning_rate": ["optim.lr"],
    "max_lr": ["optim.lr"],
    "min_lr": ["optim.min_lr_ratio"],
    "lr_warmup_steps": ["optim.warmup_steps"],
    "warmup_iters": ["optim.warmup_steps"],
    "max_grad_norm": ["optim.grad_clip"],
    "clip_grad": ["optim.grad_clip"],
    "max_norm": ["optim.grad_clip"],
    "batch_size": ["train.global_batch_size", "train.micro_batch_size"],
    "global_batch_size": ["train.global_batch_size"],
    "micro_batch_size": ["train.micro_batch_size"],
    "local_batch_size": ["train.micro_batch_size"],
    "per_device_train_batch_size": ["train.micro_batch_size"],
    "gradient_accumulation_steps": ["train.global_batch_size", "train.micro_batch_size"],
    "max_steps": ["train.steps"],
    "train_iters": ["train.steps"],
    "training_steps": ["train.steps"],
    "num_train_epochs": ["data.epochs", "train.steps"],
    "seq_length": ["data.pack.seq_len"],
    "seq_len": ["data.pack.seq_len"],
    "max_seq_len": ["data.pack.seq_len"],
    "max_seq_length": ["data.pack.seq_len"],
    "max_length": ["data.pack.seq_len"],
    "model_max_length": ["data.pack.seq_len"],
    "output_dir": ["train.run_dir"],
    "save_steps": ["train.checkpoint_every"],
    "save_interval": ["train.checkpoint_every"],
    "logging_steps": ["train.log_every"],
    "eval_steps": ["train.val_every"],
    "resume_from_checkpoint": ["train.resume"],
    "bf16": ["train.precision"],
    "mixed_precision": ["train.precision"],
}


def check_overrides(overrides, repeats: bool = True) -> None:
    """Refuse a command-line override of a field the schema lacks, naming the nearest ones (Hydra's own
    refusal names neither the fields nor the model config's names); a VLMConfig path such as
    `model.moe.capacity_factor` is pointed at the job key that sets it.  With `repeats`, a key given
    twice too (on a command line a mistake, often the shell's brace expansion)."""
    if repeats:
        _check_repeats(overrides)
    _check_group_choices(overrides)
    known, by_model_path = _known_paths()
    for item in overrides:
        key = _override_key(str(item))
        if key is None or key in known:
            continue
        name = key.rsplit(".", 1)[-1]
        near = (
            [by_model_path[key]]
            if key in by_model_path
            else FOREIGN_NAMES[name]
            if name in FOREIGN_NAMES
            else difflib.get_close_matches(key, known, n=3)
        )
        raise ConfigError(
            f"{key} is not an option"
            + (f"; did you mean {' or '.join(near)}?" if near else "")
            + " (python train.py --help lists them all)"
        )


@functools.cache
def _known_paths() -> tuple[frozenset[str], dict[str, str]]:
    """Every option's path, and each model-config path's job key (the schema is fixed in a process)."""
    known = frozenset(o.path for o in options())
    return known, {f"model.{path}": f"model.{key}" for key, path in model_fields().items()}


def _check_group_choices(overrides) -> None:
    """A config group's choice (`+experiment=NAME`, `model=NAME`, `scale=NAME`) that conf/ lacks, named
    with the nearest and every choice there is (Hydra's refusal lists neither)."""
    for item in overrides:
        match = re.match(r"(\+{0,2})([A-Za-z_]\w*)=([\w.-]+)$", str(item))
        folder = os.path.join(CONF, match.group(2)) if match else None
        if folder is None or not os.path.isdir(folder):
            continue
        plus, group, name = match.groups()
        choices = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
        if name in choices or name == "null":
            continue
        near = difflib.get_close_matches(name, choices, n=1)
        what = "a recipe of" if group == "experiment" else "a choice in"
        raise ConfigError(
            f"{plus}{group}={name} is not {what} conf/{group}/"
            + (f"; did you mean {plus}{group}={near[0]}?" if near else "")
            + f" ({group}: {', '.join(choices)})"
        )


def _check_repeats(overrides) -> None:
    """A key given twice: Hydra would keep the last.  Shards given many times are almost always a brace
    pattern the shell expanded (`data.shards=/d/s-{000..009}.tar` unquoted): the quoted spec is shown."""
    from moevlm.data.reader import shard_spec

    given: dict[str, list[str]] = {}
    for item in overrides:
        if (key := _override_key(str(item))) is not None:
            given.setdefault(key, []).append(str(item).split("=", 1)[1])
    for key, values in given.items():
        if len(values) < 2:
            continue
        seen = ", ".join(values[:3]) + (", ..." if len(values) > 3 else "")
        if key.endswith("shards"):
            raise ConfigError(
                f"{key} is given {len(values)} times ({seen}): the shell expanded a brace pattern, and "
                f"only the last would be used; quote it: {key}=\"'{shard_spec(values)}'\""
            )
        raise ConfigError(
            f"{key} is given {len(values)} times ({seen}) and only the last would be used; give it once"
        )


def _override_key(item: str) -> str | None:
    """`section.field` of a plain override `section.field=value` (or a bare name another trainer uses,
    FOREIGN_NAMES); None for group choices, `+`/`~` edits, hydra.* and flags."""
    match = re.match(r"([A-Za-z_][\w.]*)=", item)
    if not match:
        return None
    key = match.group(1)
    if "." not in key:  # a config group's choice (model=..., scale=...), or a name from elsewhere
        return key if key in FOREIGN_NAMES else None
    return key if key.split(".")[0] in {f.name for f in dataclasses.fields(JobConfig)} else None
