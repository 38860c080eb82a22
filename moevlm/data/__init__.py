"""Data: shard building, WebDataset reading, image preprocessing, tokenisation,
packing.  `image.py` (smart resize + patchify) is here now; the data issue adds
the rest."""
