"""Context-parallel work balance on real packed rows: attention and vision work per cp rank.

    python bench/cp_balance.py                      # 50 rows of the embedded sample set, cp 2 and 4
    python bench/cp_balance.py --shards DIR --rows 50 --seq-len 8192 --max-patches 16384 --cp 2 4 8

Attention work of a rank = the allowed (query, key) pairs of its queries (same document, key <= query):
what a kernel that skips masked blocks computes, proportional to its FLOPs.  Three splits of each row:
  contiguous   rank r keeps the r-th S/cp tokens (the naive split)
  zigzag-row   the row cut into 2cp chunks, rank r keeps chunks r and 2cp-1-r
  zigzag-doc   what moevlm does (cp_layout.doc_zigzag_positions): every document cut into 2cp chunks
               (sizes within one token, no padding), rank r keeps chunks r and 2cp-1-r of each
  padded-doc   every document padded to a multiple of 2cp first (Megatron's packed-sequence CP): the
               padding it adds is printed
Vision work of a rank = the patches its tower encodes: moevlm's shares (whole images, largest first to
the least loaded) vs each image encoded by the rank holding its first token.
Printed per cp: max/mean over ranks, the mean and the worst over rows (1.00 = perfect balance).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moevlm.model.attention import document_ids
from moevlm.model.image_shares import balance_images
from moevlm.parallel.cp_layout import (
    attention_work,
    contiguous_positions,
    doc_zigzag_positions,
    zigzag_positions,
)


def rows_of(shards: str | None, n: int, seq_len: int | None, max_patches: int | None):
    from moevlm.config import compose_job, validate
    from moevlm.data.loader import build_loader
    from moevlm.data.sample_cache import ensure_sample

    over = ["data.num_workers=0", f"data.shards={shards or ensure_sample()[0]}"]
    over += [f"data.pack.seq_len={seq_len}"] if seq_len else []
    over += [f"data.pack.max_patches={max_patches}"] if max_patches else []
    job = compose_job(over)
    plan = validate(job, environment=False)
    loader = build_loader(job.data, plan.model, rank=0, world=1)
    out = [next(loader) for _ in range(n)]
    if hasattr(loader, "close"):
        loader.close()
    return out, plan.model


def per_doc_work(bounds: list[int], cp: int) -> tuple[list[int], int]:
    """Allowed pairs per rank when every document is cut into 2cp chunks; and the padding it needs."""
    work, pad = [0] * cp, 0
    for a, b in zip(bounds, bounds[1:]):
        L = b - a
        if not L:
            continue
        Lp = -(-L // (2 * cp)) * 2 * cp
        pad += Lp - L
        for r in range(cp):
            for q in zigzag_positions(Lp, cp, r).tolist():
                if q < L:
                    work[r] += q + 1
    return work, pad


def ratio(xs) -> float:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shards", default=None, help="WebDataset shards (default: the embedded sample set)"
    )
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--max-patches", type=int, default=None)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    rows, model = rows_of(a.shards, a.rows, a.seq_len, a.max_patches)
    merge2 = model.vision.spatial_merge_size**2
    S = rows[0]["input_ids"].shape[-1]
    docs = statistics.mean(r["num_samples"] for r in rows)
    imgs = statistics.mean(r["num_images"] for r in rows)
    print(
        f"{len(rows)} packed rows of {S} tokens: {docs:.1f} documents and {imgs:.1f} images per row on average"
    )
    print("| cp | split | attention max/mean, mean over rows | worst row | padding added |")
    print("|---:|---|---:|---:|---:|")
    vision_lines = []
    for cp in a.cp:
        res = {"contiguous": [], "zigzag-row": [], "zigzag-doc": [], "padded-doc": []}
        vis = {"shares (ours)": [], "where the tokens land": []}
        pad_total = 0
        for r in rows:
            cu = r["cu_seqlens"][: r["num_samples"] + 1]
            bounds = sorted(set(cu.tolist()) | {0, S})
            doc = document_ids(1, S, torch.tensor(bounds, dtype=torch.int32), "cpu")
            res["contiguous"].append(
                ratio(attention_work(doc, [contiguous_positions(S, cp, k) for k in range(cp)]))
            )
            res["zigzag-row"].append(
                ratio(attention_work(doc, [zigzag_positions(S, cp, k) for k in range(cp)]))
            )
            ours = doc_zigzag_positions(bounds, cp)
            res["zigzag-doc"].append(ratio(attention_work(doc, [torch.tensor(o) for o in ours])))
            w, pad = per_doc_work(bounds, cp)
            res["padded-doc"].append(ratio(w))
            pad_total += pad
            sizes = r["image_grid_thw"][: r["num_images"]].prod(-1).tolist()
            if sizes:
                shares = balance_images(sizes, cp)
                vis["shares (ours)"].append(ratio([sum(sizes[i] for i in s) for s in shares]))
                owner = torch.empty(S, dtype=torch.long)
                for k in range(cp):
                    owner[torch.tensor(ours[k])] = k
                image_pos = (
                    (r["input_ids"].reshape(-1) == model.image_token_id).nonzero().squeeze(-1)
                )
                # each image's first token
                offsets = torch.tensor([0] + sizes[:-1]).cumsum(0) // merge2
                starts = image_pos[offsets].tolist()
                landed = [0] * cp
                for p, size in zip(starts, sizes):
                    landed[int(owner[p])] += size
                vis["where the tokens land"].append(ratio(landed))
        for name, xs in res.items():
            pad = f"{pad_total / (len(rows) * S):.1%}" if name == "padded-doc" else "0"
            print(f"| {cp} | {name} | {statistics.mean(xs):.3f} | {max(xs):.3f} | {pad} |")
        for name, xs in vis.items():
            if xs:
                vision_lines.append(
                    f"| {cp} | {name} | {statistics.mean(xs):.3f} | {max(xs):.3f} | {len(xs)} |"
                )
    print(
        "\n| cp | vision patches per rank | max/mean, mean over rows | worst row | rows with images |"
    )
    print("|---:|---|---:|---:|---:|")
    print("\n".join(vision_lines))


if __name__ == "__main__":
    main()
