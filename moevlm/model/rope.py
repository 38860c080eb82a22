"""Rotary embeddings and position ids: 2-D rotary for the vision tower, interleaved 3-D M-RoPE for
the decoder, and the 3-D position ids of a (packed) sequence.

Legend: B batch, S sequence, N vision patches, I images, V videos, hd head dim.

    pos_3BS = mrope_position_ids(input_ids_BS, grid_thw_I3, image_token_id, merge, cu_seqlens)
    pos_3BS = mrope_position_ids(ids_BS, image_grid, image_id, merge, cu, video_grid, video_id)
    cos, sin = mrope(pos_3BS, head_dim, theta, mrope_section);  q = apply_rotary(q, cos, sin)

Packed documents (`cu_seqlens`) restart positions at every document start.
"""

from __future__ import annotations

import torch

from moevlm.model.attention import doc_bounds


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., hd); cos/sin broadcastable to x's leading dims, (..., r): the first r <= hd dims turn
    (partial rotary), the rest pass."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turn, rest = x[..., :r], x[..., r:]
    return torch.cat((turn * cos + rotate_half(turn) * sin, rest), dim=-1)


def _inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


# --------------------------------------------------------------------- vision
def vision_rotary(
    pos_hw_N2: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D rotary: half of the rotated pairs follow the row, half the column.

    Returns fp32 cos, sin of shape (N, hd)."""
    inv = _inv_freq(head_dim // 2, theta, pos_hw_N2.device)  # (hd/4,)
    freqs_N2F = pos_hw_N2[..., None].float() * inv
    freqs_NF = torch.cat((freqs_N2F[:, 0], freqs_N2F[:, 1]), dim=-1)  # (N, hd/2)
    emb = torch.cat((freqs_NF, freqs_NF), dim=-1)
    return emb.cos(), emb.sin()


def vision_patch_rows_cols(grid_thw_I3: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch in the order the processor emits them: frame by
    frame, merge x merge blocks in raster order, raster order inside a block.
    Returns (N, 2) long."""
    out = []
    for t, h, w in grid_thw_I3.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rc = torch.stack((rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()), dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out).to(grid_thw_I3.device)


def pos_embed_taps(
    rows_cols_N2: torch.Tensor, grid_thw_I3: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) resampling of the learned side x side position
    table to each image grid, as 4 gather indices and weights per patch: (N, 4).
    `rows_cols_N2` is `vision_patch_rows_cols(grid_thw_I3, merge)`."""
    rc = rows_cols_N2.float()
    sizes = torch.repeat_interleave(
        grid_thw_I3[:, 1:].float(),
        (grid_thw_I3[:, 0] * grid_thw_I3[:, 1] * grid_thw_I3[:, 2]),
        dim=0,
    )
    src = rc * (side - 1) / (sizes - 1).clamp(min=1)  # (N, 2) source coordinates
    lo = src.floor()
    frac = src - lo
    lo = lo.long()
    hi = (lo + 1).clamp(max=side - 1)
    (h0, w0), (h1, w1) = lo.unbind(-1), hi.unbind(-1)
    fh, fw = frac.unbind(-1)
    idx = torch.stack((h0 * side + w0, h0 * side + w1, h1 * side + w0, h1 * side + w1), dim=-1)
    wts = torch.stack(((1 - fh) * (1 - fw), (1 - fh) * fw, fh * (1 - fw), fh * fw), dim=-1)
    return idx, wts


def vision_cu_seqlens(grid_thw_I3: torch.Tensor) -> torch.Tensor:
    """Attention segments of the vision tower: one per frame (h*w patches)."""
    per_frame = torch.repeat_interleave(grid_thw_I3[:, 1] * grid_thw_I3[:, 2], grid_thw_I3[:, 0])
    return torch.nn.functional.pad(per_frame.cumsum(0, dtype=torch.int32), (1, 0))


# ----------------------------------------------------------------------- text
def mrope(
    position_ids_3BS: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section,
    interleaved: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary for the decoder. Interleaved layout (Qwen3-VL): frequency
    slot j takes its angle from H if j % 3 == 1 (j < 3*sec_h), from W if j % 3 == 2
    (j < 3*sec_w), else from T.  Chunked layout (Qwen2-VL): consecutive sections.
    Returns cos, sin of shape (B, S, hd) in `dtype`."""
    inv = _inv_freq(head_dim, theta, position_ids_3BS.device)
    freqs_3BSF = position_ids_3BS[..., None].float() * inv
    if interleaved:
        freqs = freqs_3BSF[0].clone()
        for axis in (1, 2):
            sl = slice(axis, 3 * mrope_section[axis], 3)
            freqs[..., sl] = freqs_3BSF[axis, ..., sl]
    else:
        chunks = freqs_3BSF.split(list(mrope_section), dim=-1)
        freqs = torch.cat([c[i] for i, c in enumerate(chunks)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_position_ids(
    input_ids_BS: torch.Tensor,
    image_grid_thw_I3: torch.Tensor | None,
    image_token_id: int,
    merge: int,
    cu_seqlens: torch.Tensor | None = None,
    video_grid_thw_V3: torch.Tensor | None = None,
    video_token_id: int | None = None,
) -> torch.Tensor:
    """3-D (t, h, w) position ids of every token, as the reference computes them.

    Text advances all three by one per token.  An image of llm grid (t, h', w')
    starting at position p gets t-index p + frame, h-index p + row, w-index p + col;
    the text after it continues at p + max(h', w').  A video's temporal patches are
    placed one by one as images of grid (1, h, w) (their timestamps are text between
    them), in the order of the video tokens.  `cu_seqlens` (flat over B*S) restarts
    positions at each document.  Returns (3, B, S) long."""
    B, S = input_ids_BS.shape
    flat = input_ids_BS.reshape(-1).cpu()
    kinds = {0: flat == image_token_id}
    frames = []
    if video_grid_thw_V3 is not None and video_token_id is not None:
        kinds[1] = flat == video_token_id
        frames = [[1, h, w] for t, h, w in video_grid_thw_V3.tolist() for _ in range(t)]
    is_vis = kinds[0] | kinds[1] if 1 in kinds else kinds[0]
    vis_at = is_vis.nonzero().squeeze(-1).tolist()  # Python work is per image, not per token
    grids = {
        0: iter(image_grid_thw_I3.tolist() if image_grid_thw_I3 is not None else []),
        1: iter(frames),
    }
    out = torch.empty(3, B * S, dtype=torch.long)
    bounds, k = doc_bounds(B, S, cu_seqlens), 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        pos, i = 0, start
        while i < end:
            nxt = vis_at[k] if k < len(vis_at) and vis_at[k] < end else end
            out[:, i:nxt] = torch.arange(pos, pos + nxt - i)  # a text run
            pos, i = pos + nxt - i, nxt
            if i < end:
                kind = 1 if 1 in kinds and bool(kinds[1][i]) else 0
                grid = next(grids[kind], None)
                if grid is None:
                    name = ("image", "video")[kind]
                    raise ValueError(
                        f"token {i} is a {name} token but every {name} grid given is used up"
                    )
                n, image_pos, advance = _image_positions(grid, merge, pos, i, end, kinds[kind])
                out[:, i : i + n] = image_pos
                pos, i, k = pos + advance, i + n, k + n
    return out.view(3, B, S).to(input_ids_BS.device)


def _image_positions(grid, merge: int, pos: int, i: int, end: int, is_img: torch.Tensor):
    """(tokens, (3, tokens) positions, position advance) of one image starting at token i."""
    t, h, w = grid
    hh, ww = h // merge, w // merge
    n = t * hh * ww
    if i + n > end or not bool(is_img[i : i + n].all()):
        raise ValueError(
            f"image of grid ({t}, {h}, {w}) needs {n} consecutive image tokens inside one "
            f"document from token {i}; input_ids does not have them"
        )
    tt = torch.arange(t).view(t, 1, 1).expand(t, hh, ww)
    rr = torch.arange(hh).view(1, hh, 1).expand(t, hh, ww)
    cc = torch.arange(ww).view(1, 1, ww).expand(t, hh, ww)
    return n, torch.stack((tt, rr, cc)).reshape(3, n) + pos, max(hh, ww)
