"""Loader settings shared by the data tests."""

from moevlm.data.config import DataConfig, ImageConfig, PackConfig


def small_data_config(shards, **kw) -> DataConfig:
    """Small images and budgets: the loader tests decode every photo of the set."""
    pack = PackConfig(seq_len=512, max_patches=64, max_samples=16, max_images=8, lookahead=4, oversize="truncate")
    cfg = DataConfig(shards=str(shards), image=ImageConfig(min_pixels=32 * 32, max_pixels=64 * 64), pack=pack,
                     num_workers=2, shuffle_buffer=8, seed=1)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg
