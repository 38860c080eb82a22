"""Data: WebDataset shards of real images with text -> fixed-shape packed micro-batches.

build:   build_shards (annotations + images -> tar shards), build_inputs, build_sources, records,
         sample (the embedded set), sample_cache (built once per content version)
read:    reader (shards per stream, shuffle, positions), layouts (data.format), image, text, encode
pack:    packing (first fit, PackedRow, stack_rows), batch (MicroBatch: what the model takes)
loader:  loader (PackedLoader, build_loader), streams (read -> encode -> pack per stream), state
         (resumable, typed), lifetime (workers end with the trainer), deaf (the fork server's signals)
config:  config (DataConfig and its parts), checks (each field, the model, the layout, the files)
other:   errors (skip reasons, DataError), hf_files (processor files of an HF export), vision_balance
"""

from moevlm.exports import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "MicroBatch": "moevlm.data.batch",
        **dict.fromkeys(("DataConfig", "ImageConfig", "PackConfig"), "moevlm.data.config"),
        **dict.fromkeys(("REASONS", "DataError", "SkipSample"), "moevlm.data.errors"),
        "worker_death": "moevlm.data.lifetime",
        **dict.fromkeys(("PackedLoader", "build_loader"), "moevlm.data.loader"),
        **dict.fromkeys(("PackedRow", "stack_rows"), "moevlm.data.packing"),
        "merge_states": "moevlm.data.state",
    },
)

__all__ = [
    "MicroBatch",
    "DataConfig",
    "ImageConfig",
    "PackConfig",
    "REASONS",
    "DataError",
    "SkipSample",
    "PackedLoader",
    "PackedRow",
    "build_loader",
    "merge_states",
    "stack_rows",
    "worker_death",
]
