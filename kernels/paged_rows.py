"""Where a token's bytes live: the `@triton.jit` row addressing of a paged cache (through a slot mapping) or of plain
planes, shared by the store, the gather-dequantize and (ported by `gluon_port`) the Gluon store."""

import triton
import triton.language as tl

__all__ = ["row_addresses"]


@triton.jit
def row_addresses(tok, head, n_tok, num_heads, slot_ptr, page_stride, head_stride,
                  PAGED: tl.constexpr, PAGE: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr):
    """Tokens [BLOCK_R] of one head -> (live mask, payload byte offset, scale byte offset), offsets int64.

    PAGED: token t has slot `slot_ptr[t]` (-1 = dead row); per page and head the bytes are
    `[PAGE x PB payload][PAGE x SB scale]`. Planes: row r = t * H + head has its payload at r * PB and scales at
    r * SB."""
    live = tok < n_tok
    if PAGED:
        slot = tl.load(slot_ptr + tok, mask=live, other=-1).to(tl.int32)
        live = live & (slot >= 0)
        base = (slot // PAGE).to(tl.int64) * page_stride + head * head_stride
        off = slot % PAGE
        pay = base + off * PB
        sc = base + PAGE * PB + off * SB
    else:
        rows = tok.to(tl.int64) * num_heads + head
        pay = rows * PB
        sc = rows * SB
    return live, pay, sc
