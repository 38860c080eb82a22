"""The exports at the end of a run: train.export_adapter (PEFT) and train.export_hf (an HF folder),
each all or nothing into a folder this run may replace (moevlm.parallel.hf_io.export_folder).

    export_run(trainer)        # collective under a layout; a refusal or failed write: ExportFailed
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moevlm.data.hf_files import write_processor_files
from moevlm.parallel.hf_io import (
    ExportTargetError,
    export_folder,
    export_marker,
    save_adapter,
    save_hf,
)
from moevlm.train.integrity import write_failed_line
from moevlm.train.setup import export_protected

if TYPE_CHECKING:
    from moevlm.train.trainer import Trainer


class ExportFailed(RuntimeError):
    """train.export_hf or train.export_adapter refused or not written at the end of a run: one line,
    ExitCode.CHECKPOINT; the checkpoints (and an earlier export) are intact."""


def export_run(tr: Trainer) -> None:
    """train.export_adapter, then train.export_hf, of the trainer's current weights."""
    if tr.t.export_adapter:
        _export(
            tr,
            "train.export_adapter",
            "peft_adapter",
            lambda out: save_adapter(tr.model, out, ctx=tr.parallel),
        )
        tr.log.info(f"exported the LoRA adapters to {tr.t.export_adapter} (PEFT format)")
    if tr.t.export_hf:
        _export_hf(tr, tr.t.export_hf)


def _export(tr: Trainer, option: str, kind: str, write) -> None:
    """One export into the folder `option` names; its refusal or a failed write: ExportFailed."""
    target = Path(getattr(tr.t, option.split(".")[1])).absolute()
    try:
        export_folder(
            target,
            write,
            run_dir=tr.run_dir,
            step=tr.step,
            kind=kind,
            option=option,
            protected=export_protected(tr.plan, option),
            ctx=tr.parallel,
        )
    except (ExportTargetError, OSError, MemoryError) as err:
        why = str(err) if isinstance(err, ExportTargetError) else write_failed_line(err, target)
        why = why.split("; the checkpoints are intact")[0]
        before = (
            "what was there is intact" if export_marker(target) else "nothing was written there"
        )
        kept = tr.ckpt.complete()
        again = f"the run's checkpoint {kept[-1]} is intact" if kept else "no checkpoint was kept"
        raise ExportFailed(
            f"export {'refused' if isinstance(err, ExportTargetError) else 'failed'}: {why}; "
            f"{before}; {again} (relaunch with {option} naming a new folder: the run resumes "
            "at its last step and exports)"
        ) from None


def _export_hf(tr: Trainer, out: str) -> None:
    """Weights and config (collective under a layout), then rank 0 (which reads the data: the first
    stage) adds the tokenizer, chat template and image-processor files: a folder transformers loads.
    LoRA adapters are merged into the weights written."""
    if tr.plan.model.lora.rank:
        tr.log.info("merging the LoRA adapters into the exported weights")

    def write(folder: Path) -> None:
        save_hf(tr.model, folder, ctx=tr.parallel)
        if tr.rank == 0:
            write_processor_files(
                folder,
                tokenizer=tr.loader.tokenizer_path,
                image=tr.plan.data.image,
                source=tr.plan.job.model.hf_checkpoint or None,
            )

    _export(tr, "train.export_hf", "hf", write)
    tr.log.info(
        f"exported Hugging Face checkpoint to {out} (weights, config, tokenizer, chat template, "
        "image processor)"
    )
