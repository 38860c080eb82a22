"""What a job asks of this machine (device, backend, packages) and of the files it names, each a check
that raises ConfigError naming what to change.

    for c in environment_checks(job): c()
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from moevlm.data.checks import check_shards, shown_path
from moevlm.errors import ConfigError, check
from moevlm.model.attention import varlen_available, varlen_missing
from moevlm.model.config import VLMConfig

WANDB_MISSING = (
    "train.wandb={mode!r} needs the wandb package, which is not installed: pip install wandb "
    "(or the moevlm[wandb] extra), or set train.wandb=disabled"
)


def wandb_installed() -> bool:
    """Whether `import wandb` can work, without importing it (it takes a second or two)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # in sys.modules without a spec
        return sys.modules.get("wandb") is not None


TRITON_OPTIONS = ("model.grouped_gemm", "model.permute")


def environment_checks(job) -> list:
    """Checks of what the config asks of this machine (device, backend, packages) and of the files it
    names; each a no-argument callable raising ConfigError, so every problem is reported."""
    t, m, p = job.train, job.model, job.parallel
    cuda = torch.cuda.is_available()
    on_cpu = t.device == "cpu" or not cuda  # (device=cuda without CUDA is its own error)
    checks = [
        lambda: check(
            t.device != "cuda" or cuda,
            f"train.device=cuda but {_why_no_cuda()}; use train.device=auto (CPU here) or cpu",
        ),
        lambda: check(
            p.backend != "nccl" or not on_cpu,
            "parallel.backend=nccl needs CUDA devices but this job runs on the CPU; use parallel.backend=auto "
            "(gloo on the CPU)",
        ),
    ]
    for key in TRITON_OPTIONS:
        value = getattr(m, key.split(".")[1])
        checks.append(
            lambda key=key, value=value: check(
                value != "triton" or not on_cpu or os.environ.get("TRITON_INTERPRET") == "1",
                f"{key}=triton runs Triton kernels, which need a CUDA device; on the CPU use {key}=torch (or set "
                "TRITON_INTERPRET=1 before launching to run them in Triton's interpreter: very slow, for tests)",
            )
        )
    checks.append(
        lambda: check(
            not m.cuda_graph_scope or not on_cpu,
            f"model.cuda_graph_scope={graph_scope(m)} captures CUDA graphs, which need a CUDA device; "
            "this job runs on the CPU: use model.cuda_graph_scope=[] (or train.device=cuda on a "
            "GPU machine)",
        )
    )
    checks.append(
        lambda: check(
            t.cuda_graph == "off" or not on_cpu,
            "train.cuda_graph=step captures CUDA graphs, which need a CUDA device; this job runs on the "
            "CPU: use train.cuda_graph=off (or train.device=cuda on a GPU machine)",
        )
    )
    checks.append(
        lambda: check(
            m.attn_backend != "flash" or importlib.util.find_spec("flash_attn") is not None,
            "model.attn_backend=flash needs the flash-attn package, which is not installed "
            "(pip install flash-attn, CUDA only); use model.attn_backend=auto",
        )
    )
    checks.append(
        lambda: check(
            m.attn_backend != "varlen" or (not on_cpu and varlen_available()),
            f"model.attn_backend=varlen needs {_varlen_needs(on_cpu)}; use "
            "model.attn_backend=auto (sdpa on the CPU)",
        )
    )
    checks += [
        lambda: _check_hf_checkpoint(m.hf_checkpoint),
        # (model.hf_config: read by model_config, which says when it is missing or unreadable)
        lambda: _check_path(
            "" if t.resume in ("auto", "none") else t.resume,
            "train.resume",
            "a checkpoint folder (checkpoints/step_NNNNNNNN), auto or none",
            folder=True,
        ),
        lambda: data_problem(check_shards, job.data.shards, job.data.split),
        lambda: data_problem(check_val_shards, job.data.val_shards, job.data.split),
    ]
    return checks


def _varlen_needs(on_cpu: bool) -> str:
    if on_cpu:
        return "a CUDA device (torch's varlen_attn is a flash-attention kernel) but this job runs on the CPU"
    return varlen_missing() or "a CUDA device"


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})"


def _check_path(path: str, key: str, what: str, folder: bool = False) -> None:
    if path:
        check(
            os.path.isdir(path) if folder else os.path.exists(path),
            f"{key}={shown_path(path)} does not exist{' or is not a folder' if folder else ''}; "
            f"give {what}",
        )


HF_FOLDER = (
    "an HF Qwen3-VL-MoE folder (config.json, and model.safetensors or model.safetensors.index.json)"
)


def _check_hf_checkpoint(path: str) -> None:
    """model.hf_checkpoint holds a config and every weight file it needs (what the load opens after the
    model is built); the architecture is compared once the model config is known (`check_hf_architecture`)."""
    from moevlm.model.hf import checkpoint_files

    _check_path(path, "model.hf_checkpoint", HF_FOLDER, folder=True)
    if not path:
        return
    key = f"model.hf_checkpoint={shown_path(path)}"
    check(
        os.path.isfile(os.path.join(path, "config.json")),
        f"{key} has no config.json; give {HF_FOLDER}, or leave model.hf_checkpoint empty to start "
        "from random weights",
    )
    try:
        files = checkpoint_files(Path(path))
    except FileNotFoundError:
        raise ConfigError(
            f"{key} has a config.json but no weights (neither model.safetensors nor "
            f"model.safetensors.index.json); give {HF_FOLDER}, or set model.hf_config={os.path.abspath(path)} "
            "to take only its architecture (random weights)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}: model.safetensors.index.json cannot be read ({type(err).__name__}: {err}); it must "
            "be JSON with a weight_map"
        ) from None
    missing = [f.name for f in files if not f.is_file()]
    check(
        not missing,
        f"{key}: model.safetensors.index.json names {len(missing)} weight file(s) that are not in the "
        f"folder, e.g. {missing[:3]}; copy them there (a download cut short?)",
    )


def check_hf_architecture(path: str, model: VLMConfig) -> None:
    """The checkpoint's config.json describes the model being built (weights are copied by name and
    shape), then every weight file's safetensors header is sound (a truncated download, an absurd
    header: one line naming the file, not the library's error once the model is built)."""
    from moevlm.model.hf import (
        CheckpointError,
        check_architecture,
        checkpoint_files,
        safetensors_problem,
    )

    key = f"model.hf_checkpoint={shown_path(path)}"
    try:
        check_architecture(Path(path), model)
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}: its config.json is not a Qwen3-VL-MoE config ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None
    try:
        files = [f for f in checkpoint_files(Path(path)) if f.is_file()]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no weights, or an unreadable index: _check_hf_checkpoint's line
    for file in files:
        if (problem := safetensors_problem(file)) is not None:
            raise ConfigError(f"{key}: {file.name} {problem}; download or export it again")


def data_problem(check, *args) -> None:
    """`check` (moevlm.data.config) raises ValueError; here every problem is a ConfigError."""
    try:
        check(*args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_val_shards(spec: str, split: str = "") -> None:
    """data.val_shards as data.shards is checked, its messages naming data.val_shards."""
    try:
        check_shards(spec, split)
    except ValueError as err:
        raise ConfigError(str(err).replace("data.shards=", "data.val_shards=")) from None


def graph_scope(m) -> str:
    """model.cuda_graph_scope as written on a command line."""
    return "[" + ",".join(str(s) for s in m.cuda_graph_scope) + "]"
