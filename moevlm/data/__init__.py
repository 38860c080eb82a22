"""Data: WebDataset shards of real images with text -> fixed-shape packed micro-batches.

build_shards.py  annotations (LLaVA JSON/JSONL, caption JSONL) + images -> tar shards; --sample
build_inputs.py  the build's untrusted inputs: paths kept inside --images, byte caps before reading
records.py       every record form -> one canonical Record
sample.py        the embedded sample set: photos and prose that installed packages ship
sample_cache.py  data.shards=sample: that set built once per content version in ~/.cache/moevlm
image.py         bytes -> RGB (EXIF, modes, bomb guard, JPEG draft) -> smart resize -> patches
text.py          tokenizer, Qwen chat template, assistant-only loss mask
encode.py        one raw sample -> Sample (tokens, labels, 3-D positions, pixels)
reader.py        shard split per stream and epoch, seeded shuffle, resumable positions
packing.py       first-fit packing to fixed token / patch / image budgets; stack_rows: rows -> one batch
batch.py         MicroBatch: stacked rows + token mask, FLOPs, counts: what the model and trainer take
loader.py        layout-independent streams over ranks and workers, exact-resume state, skip statistics
lifetime.py      the workers end with the process using the loader (parent-death signal, pid probe)
errors.py        SkipSample reasons; DataError (the data can feed nothing)
hf_files.py      tokenizer, chat template and image-processor files for an exported HF folder
"""

from moevlm.data.batch import MicroBatch
from moevlm.data.config import DataConfig, ImageConfig, PackConfig
from moevlm.data.errors import REASONS, DataError, SkipSample
from moevlm.data.loader import PackedLoader, build_loader, merge_states
from moevlm.data.packing import stack_rows

__all__ = [
    "MicroBatch",
    "DataConfig",
    "ImageConfig",
    "PackConfig",
    "REASONS",
    "DataError",
    "SkipSample",
    "PackedLoader",
    "build_loader",
    "merge_states",
    "stack_rows",
]
