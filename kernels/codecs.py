"""Shared `@triton.jit` codec helpers: one per element codec and block recipe. Every kernel imports these; nothing
re-implements them. Each helper gives the same bits as a torch reference in `kvtool/formats/`: where a rounding step
decides the result, the same fp32 operations in the same order (IEEE division through `tl.math.div_rn`); elsewhere a
cheaper sequence that gives the same codes (e.g. `e2m1_encode`'s fma/min form, compared with the torch threshold rule
in tests/kernels/test_kernel_codecs.py on random fp32 bit patterns of every exponent, the edge cases and every E2M1 code).

Portability: the default paths use only integer bit logic, fp32/fp16 arithmetic and bitcasts: no inline asm, no lookup
tables in memory (`rcp_table` builds the one optional table, which only the NVIDIA Gluon store gathers from), no fp32
-> fp8 casts (the interpreter rounds them wrongly). Hardware fp8 conversions (`NATIVE=True`)
are used only where a launcher's capability check allows them (CUDA sm_89+); the portable path is what the interpreter
tests, and GPU tests compare the two.

Rule and recipe arguments are constexpr ints: the values of `kvtool.formats.rules.ScaleRule`, `NvRecipe`.

Some decodes exist in more than one op sequence (E2M1: e2m1_words_f16, fp4_quarter, e2m1_words_paired, fp4_bytes;
E4M3: e4m3_decode_f16, e4m3_decode_to; E8M0 factors: e8m0_word_factors, e8m0_tile_factors). They compile to different
layouts and integer-op counts, and each kernel keeps the one it was verified with on the H200; each docstring says
who uses it and how it differs. Decodes to `value * 2**-14` (or 2**-8) leave that power of two to the caller's scale.
"""

import triton
import triton.language as tl

from kvtool.kernels import platform

__all__ = [
    "DS_AMAX_FLOOR", "E2M1_MAX", "E2M1_T_BITS", "E2M1_T_WORD", "E4M3_MAX", "INTERPRET", "RECIPE_DIV", "RECIPE_RCP",
    "RECIPE_UNROUNDED", "RULE_CEIL", "RULE_EVEN", "RULE_FLOOR", "RULE_RCEIL", "amax_div6", "bf16_decode", "bf16_encode",
    "e2m1_decode_f16", "e2m1_decode_f32", "e2m1_encode", "e2m1_pair", "e2m1_pairs", "e2m1_words", "e2m1_words_bf16",
    "e2m1_words_f16", "e2m1_words_paired", "e4m3_decode", "e4m3_decode_any", "e4m3_decode_f16", "e4m3_decode_to",
    "e4m3_encode", "e8m0_decode", "e8m0_decode_any", "e8m0_from_field", "e8m0_tile_factors", "e8m0_word_factors",
    "exp2_int", "fp4_bytes", "fp4_quantize_blocks", "fp4_quarter", "fp4_scaled_words", "fp8_encode_scaled",
    "fp8_row_scale", "mx_exponent",
    "mx_rceil_exponent", "mxfp4_quantize_block", "mxfp4_quantize_block_fast", "mxfp4_scale_block",
    "nvfp4_quantize_block", "nvfp4_quantize_block_fast", "nvfp4_scale_block", "nvfp4_scaled", "pack_nibble_words",
    "pack_nibbles", "paired_cols", "pow2_f16", "rcp_table", "unpack_nibbles", "zero_add"
]

# Constexpr copies of kvtool.formats.rules values (a kernel cannot import Python enums). Tests assert they agree.
RULE_FLOOR = tl.constexpr(0)
RULE_EVEN = tl.constexpr(1)
RULE_CEIL = tl.constexpr(2)
RULE_RCEIL = tl.constexpr(3)
RECIPE_RCP = tl.constexpr(0)
RECIPE_DIV = tl.constexpr(1)
RECIPE_UNROUNDED = tl.constexpr(2)

E2M1_MAX = tl.constexpr(6.0)  # 0b0_11_1: 2**(3 - 1) * 1.5
E4M3_MAX = tl.constexpr(448.0)  # 0b0_1111_110: 2**(15 - 7) * 1.75 (0b0_1111_111 is NaN)


# ------------------------------------------------------------------------------------------------------------ E2M1
@triton.jit
def e2m1_encode(y, SATURATE: tl.constexpr = True, low=7):
    """fp32 -> E2M1 code (int32 0..15), round half to even, saturating at 6, sign bit 3 also for -0.

    E2M1 rounding of m = |y| is round-half-even of the concave piecewise-linear code line
    `g(m) = min(2m, m + 2, m / 2 + 4)` (codes 0..4 step 0.5, 4..6 step 1, 6..7 step 2), clamped at 7. Round-half-even
    is monotone, so it commutes with the min, and `RNE(m * k) + c` (c even) is one fp32 fma against `2**23 + c`: the
    sum's low mantissa bits are the code. Midpoints 0.25, 1.25, 2.5, 5 land on .5 with an even floor and tie down (0, 1,
    2, 4); 0.75, 1.75, 3.5 tie up (1, 2, 4): the SPEC table. Three fmas and four mins, no compare-select chain: the
    store kernels are bound by integer-pipe issue, and a seven-threshold count costs about three times as many ALU
    ops. The products m * k are exact (k is a power of two), so contraction into fma does not change a bit. NaN is
    refused before encoding (SPEC); Inf saturates to 7. SATURATE=False drops the clamp at code 7 for callers that
    guarantee |y| < 7 (where the clamp changes nothing; one integer-pipe op less per value).
    Codes stay int32 until pack_nibbles narrows whole bytes: uint8 codes cost byte shuffles (PRMT) on the GPU, about
    1.4 integer-pipe ops per value in the store kernel.
    """
    m = tl.abs(y)
    t = tl.minimum(m * 2.0 + 8388608.0, m + 8388610.0)  # 2**23, 2**23 + 2
    t = tl.minimum(t, m * 0.5 + 8388612.0)  # 2**23 + 4
    if SATURATE:
        t = tl.minimum(t, 8388615.0)  # code 7 (6.0)
    # sign: y's bits 28..31 moved to 0..3 by a logical shift (zeros above), then one bit-select with `low` = 7:
    # bits 0..2 from t, the rest from the shifted sign. Kernels pass `low` as a runtime 7 so that the compiler cannot
    # narrow `~low` to 8 with what it knows of the shift and split the select into two ops (one op per value less).
    sign = (y.to(tl.uint32, bitcast=True) >> 28).to(tl.int32)
    return (t.to(tl.int32, bitcast=True) & low) | (sign & ~low)


@triton.jit
def e2m1_decode_f16(code):
    """E2M1 code (low nibble of a uint8/int) -> fp16 value, without a table: place the 3 magnitude bits at the top of
    an fp16 exponent/mantissa (`(c & 7) << 9`), the sign at bit 15, then scale by 2**14 (exact in fp16)."""
    c = code.to(tl.int16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def e2m1_decode_f32(code):
    """E2M1 code -> fp32 value (through the exact fp16 decode)."""
    return e2m1_decode_f16(code).to(tl.float32)


@triton.jit
def pack_nibbles(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] codes (int32 or uint8) -> [ROWS, COLS // 2] uint8 bytes: element 2i low nibble, 2i+1 high nibble.
    The pair is combined in int32 and only the byte is narrowed."""
    pairs = tl.reshape(codes.to(tl.int32), [ROWS, COLS // 2, 2])
    lo, hi = tl.split(pairs)
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)


@triton.jit
def pack_nibble_words(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] int32 codes 0..15 -> [ROWS, COLS // 8] int32 words holding the pack_nibbles bytes little-endian
    (element 8i + k in nibble k of word i: the e2m1_words_f16 order). Codes are whole nibbles, so the fields are
    disjoint and each join is one shift-add (LEA / IMAD): 7 integer ops per 8 codes, then one 4-byte store instead of
    byte narrowing and byte permutes. The three splits halve the innermost axis, which a thread holds whole when it
    holds 8 consecutive codes (a 16-byte vector of bf16 input), so no data moves between threads."""
    c = tl.reshape(codes, [ROWS, COLS // 8, 2, 2, 2])  # k = 4 k2 + 2 k1 + k0, k0 innermost
    even, odd = tl.split(c)
    b = even + (odd << 4)  # bytes [ROWS, COLS // 8, 2, 2] (k2, k1)
    lo, hi = tl.split(b)
    h = lo + (hi << 8)  # 16-bit halves [ROWS, COLS // 8, 2] (k2)
    lo, hi = tl.split(h)
    return lo + (hi << 16)


@triton.jit
def unpack_nibbles(packed, ROWS: tl.constexpr, HALF_COLS: tl.constexpr):
    """[ROWS, HALF_COLS] bytes -> [ROWS, 2 * HALF_COLS] codes (inverse of pack_nibbles)."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return tl.reshape(tl.join(lo, hi), [ROWS, HALF_COLS * 2])


@triton.jit
def _e2m1_nibble_f16(words, K: tl.constexpr):
    """Nibble K of int32 words -> fp16 value * 2**-14 (see e2m1_words_f16)."""
    bits = ((words << (28 - 4 * K)) >> 19) & 0x8E00
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e2m1_words_f16(words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Packed E2M1 as int32 words [ROWS, WORDS] (4 packed bytes each, little-endian: element 8i + k is nibble k of
    word i, the pack_nibbles order) -> fp16 [ROWS, 8 * WORDS] in element order, holding value * 2**-14 (exact, also
    the 0.5 code as an fp16 subnormal): multiply by 2**14, or fold it into a scale. Per element three integer ops:
    shift the nibble to bits 28..31, arithmetic shift right by 19 (the sign smears over bits 12..15 and the magnitude
    lands in bits 9..11, the fp16 exponent / mantissa of e2m1_decode_f16), keep bits 15 and 9..11 (0x8E00). About
    half the integer-pipe work of unpack_nibbles + e2m1_decode_f16 per element: no byte extraction, no sign shift.
    The eight nibbles are joined pairwise (tl.join keeps the new axis inside a thread), so each thread expands its
    own words without data movement."""
    # tl.join appends the new axis last: join over bit 2 of k first, bit 0 last, so k = 4 k2 + 2 k1 + k0 flattens
    even = tl.join(tl.join(_e2m1_nibble_f16(words, 0), _e2m1_nibble_f16(words, 4)),
                   tl.join(_e2m1_nibble_f16(words, 2), _e2m1_nibble_f16(words, 6)))
    odd = tl.join(tl.join(_e2m1_nibble_f16(words, 1), _e2m1_nibble_f16(words, 5)),
                  tl.join(_e2m1_nibble_f16(words, 3), _e2m1_nibble_f16(words, 7)))
    return tl.reshape(tl.join(even, odd), [ROWS, WORDS * 8])


@triton.jit
def _e2m1_nibble_bf16(words, K: tl.constexpr):
    """Nibble K of int32 words -> bf16 value * 2**-126 (see e2m1_words_bf16)."""
    bits = ((words << (28 - 4 * K)) >> 22) & 0x81C0
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_words_bf16(words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """e2m1_words_f16 for bf16: packed E2M1 words [ROWS, WORDS] -> bf16 [ROWS, 8 * WORDS] in element order holding
    value * 2**-126 (the magnitude bits at the bottom of the bf16 exponent / top of the mantissa, bits 6..8; the
    0.5 code as a bf16 subnormal; sign at bit 15; exact). Multiply by 2**126 (exact in bf16) and a power-of-two or
    E4M3 scale with packed bf16 math: every product is exact, so no conversion to fp32 and back is needed."""
    even = tl.join(tl.join(_e2m1_nibble_bf16(words, 0), _e2m1_nibble_bf16(words, 4)),
                   tl.join(_e2m1_nibble_bf16(words, 2), _e2m1_nibble_bf16(words, 6)))
    odd = tl.join(tl.join(_e2m1_nibble_bf16(words, 1), _e2m1_nibble_bf16(words, 5)),
                  tl.join(_e2m1_nibble_bf16(words, 3), _e2m1_nibble_bf16(words, 7)))
    return tl.reshape(tl.join(even, odd), [ROWS, WORDS * 8])

@triton.jit
def fp4_quarter(w, K: tl.constexpr, TILE_T: tl.constexpr, NW: tl.constexpr):
    """Packed E2M1 as uint32 words [T, NW] (element 8j + k in nibble k of word j) -> fp16 [T, 2 NW]: column 2j holds
    element 8j + K, column 2j + 1 element 8j + K + 4, each as its E2M1 value times 2**-14, exactly: the bits of
    e2m1_decode_f16 before its final multiply by 2**14 (magnitude bits at 9..11, sign at 15), built for two
    elements at once in one 32-bit word (about two integer ops per element instead of six).
    Why these pairs: nibbles K and K + 4 sit 16 bits apart, like the two fp16 halves of a word.
    Used by the index scorer (kernels/index_score.py) for FP4 keys at head dims >= 128: it dots each quarter with
    the query loaded in the same order and chains the four dots. e2m1_words_paired (sparse attention) builds the
    same pairs from int32 words but joins the four quarters into one [T, 8 NW] tile for one dot; the two op
    sequences compile differently and each was verified in its own kernel on the H200, so they stay separate."""
    MAG: tl.constexpr = 9 - 4 * K  # nibble K's magnitude bits 4K..4K+2 -> 9..11 (and 16 bits up for K + 4)
    SGN: tl.constexpr = 12 - 4 * K  # its sign bit 4K + 3 -> 15
    if MAG >= 0:
        m = w << MAG
    else:
        m = w >> (-MAG)
    bits = (m & 0x0E000E00) | ((w << SGN) & 0x80008000)
    lo = (bits & 0xFFFF).to(tl.uint16)
    hi = (bits >> 16).to(tl.uint16)
    return tl.reshape(tl.join(lo, hi), [TILE_T, 2 * NW]).to(tl.float16, bitcast=True)


@triton.jit
def fp4_bytes(b):
    """Packed E2M1 bytes uint8 [T, D/2] (element 2c in the low nibble of byte c) -> (even, odd) fp16 [T, D/2]:
    elements 2c and 2c + 1 as their E2M1 values times 2**-14, exactly (the bits of fp4_quarter, one nibble at a
    time; e2m1_decode_f16 without its multiply). The index scorer's decode for head dims below 128, where the word
    tiles are so small that the compiler gives them layouts with lanes holding copies of each other (see
    index_score.max_warps); no join / reshape on this path."""
    c = b.to(tl.int16)
    lo = ((c & 7) << 9) | ((c & 8) << 12)
    hi = ((c & 0x70) << 5) | ((c & 0x80) << 8)
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_pair(words, K: tl.constexpr):
    """Nibbles K and K + 4 of int32 words (any shape; 16 bits apart, like the two halves of an fp16 pair) -> int32
    of the same shape holding both fp16 values * 2**-14 (nibble K in the low half): each magnitude shifted to bits
    9..11 (25..27), each sign to bit 15 (31), the bits of e2m1_decode_f16 before its multiply by 2**14. Four integer
    ops per two elements. The building block of e2m1_words_paired (sparse attention); fp4_quarter (index scorer)
    does the same on uint32 words and splits the halves itself."""
    MAG: tl.constexpr = 9 - 4 * K  # magnitude bits 4K..4K+2 -> 9..11 (and 16 up)
    SGN: tl.constexpr = 12 - 4 * K  # sign bit 4K + 3 -> 15 (and 16 up)
    if MAG >= 0:
        m = words << MAG
    else:
        m = words >> (-MAG)  # the bits an arithmetic shift smears in are masked off
    return (m & 0x0E000E00) | ((words << SGN) & -0x7FFF8000)  # 0x80008000 as an int32


@triton.jit
def e2m1_pairs(words, lo3=0x07070707, sign8=-0x7F7F7F80):
    """All four e2m1_pair results of int32 / uint32 words (any shape): (p0, p1, p2, p3), p_K = e2m1_pair(words, K)
    bit for bit, in 11 integer ops per word instead of 16. Why it is cheaper: an fp16 pair wants each nibble's sign
    6 bits above its magnitude's low bit (bit 15 over bits 9..11), so two words are prepared once in which every
    byte has that spacing: e holds the low nibbles' magnitudes at bits 0..2 and their signs moved up to bit 6
    (`w << 3` under a bit-select), y the high nibbles' signs at bit 7 and their magnitudes moved down to bits 1..3
    (`w >> 3`); then each pair is one shift of e or y and one mask 0x8E008E00 (the mask also drops the bits the
    bit-selects left in between), and pair 3 needs no shift. Used by the Gluon index scorer and by sparse
    attention's e2m1_words_paired. lo3 / sign8: the bit-select masks 0x07070707 / 0x80808080 (as int32); a kernel
    that passes them as run-time values (kernel arguments) gets each bit-select as one LOP3 with the mask in a
    register, where constant masks compile to two (LLVM splits the select around the immediates)."""
    # int32 throughout (masks as int32: 0x80808080 is -0x7F7F7F80, 0x8E008E00 is -0x71FF7200); the bits an
    # arithmetic `>> 3` smears into y's bits 29..30 are never used (shifted out of p1, masked out of p3)
    w = words.to(tl.int32, bitcast=True)
    e = (w & lo3) | ((w << 3) & ~lo3)  # byte: low nibble's magnitude at 0..2, its sign at 6
    y = (w & sign8) | ((w >> 3) & ~sign8)  # byte: high nibble's magnitude at 1..3, its sign at 7
    p0 = ((e << 9) & -0x71FF7200).to(words.dtype, bitcast=True)  # nibbles 0, 4
    p1 = ((y << 8) & -0x71FF7200).to(words.dtype, bitcast=True)  # nibbles 1, 5
    p2 = ((e << 1) & -0x71FF7200).to(words.dtype, bitcast=True)  # nibbles 2, 6
    p3 = (y & -0x71FF7200).to(words.dtype, bitcast=True)  # nibbles 3, 7
    return p0, p1, p2, p3


@triton.jit
def e2m1_words_paired(words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Packed E2M1 int32 words [ROWS, WORDS] (element 8i + k in nibble k of word i) -> fp16 [ROWS, 8 WORDS] holding
    value * 2**-14 like e2m1_words_f16, but in PAIRED order: column 8i + r holds element 8i + bitrev3(r) (r =
    4 b2 + 2 b1 + b0 -> 4 b0 + 2 b1 + b2; an involution, see paired_cols). Why: the pair (column 2m, 2m + 1) is
    then (nibble K, nibble K + 4) of one word, built by e2m1_pair in one 32-bit register, which is exactly an
    fp16x2 dot operand register: no repacking, half the integer ops of the natural order (which builds each element
    alone and packs pairs with a byte permute). The caller permutes the other dot operand (q) and the output alike;
    block scales are unaffected (a column stays in its word, so in its 16- or 32-element block). Used by sparse
    attention (kernels/sparse_attn.py, PAIRED launches); the index scorer's fp4_quarter keeps the quarters apart."""
    lo0, lo1, lo2, lo3 = e2m1_pairs(words)
    # join appends the new axis last: [.., K & 1, K >> 1] then the half (nibble K or K + 4) innermost
    lo = tl.join(tl.join(lo0.to(tl.int16), lo1.to(tl.int16)), tl.join(lo2.to(tl.int16), lo3.to(tl.int16)))
    hi = tl.join(tl.join((lo0 >> 16).to(tl.int16), (lo1 >> 16).to(tl.int16)),
                 tl.join((lo2 >> 16).to(tl.int16), (lo3 >> 16).to(tl.int16)))
    return tl.reshape(tl.join(lo, hi), [ROWS, WORDS * 8]).to(tl.float16, bitcast=True)


@triton.jit
def paired_cols(c):
    """Column c (int32, any shape) of a PAIRED-order tile (e2m1_words_paired) <-> element 8 (c // 8) +
    bitrev3(c % 8) (its own inverse). Sparse attention loads q and stores its output in this order on PAIRED
    launches; `sparse_attn.paired_order` is the torch form."""
    r = c % 8
    return c - r + ((r & 1) << 2) + (r & 2) + (r >> 2)


# ------------------------------------------------------------------------------------------------------------ E4M3
@triton.jit
def e4m3_encode(x, NATIVE: tl.constexpr = False):
    """fp32 -> E4M3FN byte (uint8): clamp to [-448, 448], round half to even with integer logic. -0 -> 0x80.

    NATIVE (a capability-checked fast path, set by launchers only on CUDA sm_89+): the hardware
    `cvt.rn.satfinite.e4m3x2.f32`, the same round-half-even and saturation at 448 in one instruction per two values
    instead of about 25 integer ops. The portable path below is what the interpreter tests; GPU tests compare the
    native path with torch.

    Normal results (|x| >= 2**-6, fp32 biased exponent >= 121): add the RNE bias to the 20 dropped mantissa bits and
    shift; the carry moves into the exponent by itself, and the rebias is `- (120 << 3)`. Subnormal results (step
    2**-9): round `M * 2**(e32 - 141)` to an integer, where M is the 24-bit significand; shifts past 25 give 0.
    """
    if NATIVE:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    xc = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    bits = xc.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e32 = a >> 23
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e32, 21), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(e32 >= 121, normal, sub)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def e4m3_decode(byte):
    """E4M3FN byte -> fp32, by bits: normal `(e + 120) << 23 | m << 20`, subnormal `m * 2**-9`."""
    b = byte.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2**-9
    mag = tl.where(e == 0, sub, normal).to(tl.int32, bitcast=True)
    # the sign goes in by bits: negation may be lowered as 0 - x, which loses -0
    return (mag | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode_f16(byte, SCALED: tl.constexpr = True):
    """E4M3FN bytes (uint8, any shape) -> fp16 of that shape, exact (every E4M3 value is an fp16 value): the 7
    exponent/mantissa bits go to fp16 bits 7..13 and the sign to bit 15, which is the value times 2**-8 (E4M3
    subnormals land on fp16 subnormals); SCALED multiplies by 2**8 (the rebias 15 - 7), otherwise the caller folds
    2**8 into an fp32 factor. 0x7F / 0xFF decode to NaN (torch float8_e4m3fn). Cheaper than e4m3_decode (fp32) on a
    whole key tile. Used by the index scorer (kernels/index_score.py): fp8 key tiles (SCALED=False) and nvfp4 block
    scales, where no hardware fp8 conversion is used; sparse attention uses e4m3_decode_to instead."""
    b = byte.to(tl.int16) & 0xFF
    v = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    if SCALED:
        v = v * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e4m3_decode_to(b, NATIVE_FP8: tl.constexpr, F16: tl.constexpr):
    """E4M3 bytes (uint8, any shape) -> fp16 (F16) or fp32 of that shape: the hardware conversion (NATIVE_FP8, set
    by launchers on CUDA sm_89+ only; two bytes per instruction), or the portable bit decode e4m3_decode, cast to
    fp16 with F16 (exact: E4M3 values are fp16 values). The NaN codes 0x7F / 0xFF (never written by kvtool) give
    NaN natively but +-480 on the portable path; e4m3_decode_any / e4m3_decode_f16 map them to NaN on both. Used by
    sparse attention (kernels/sparse_attn.py) for fp8 K/V tiles and nvfp4 block scales."""
    if NATIVE_FP8 and F16:
        x = b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif NATIVE_FP8:
        x = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif F16:
        x = e4m3_decode(b).to(tl.float16)
    else:
        x = e4m3_decode(b)
    return x


# ------------------------------------------------------------------------------------------------------------ E8M0
@triton.jit
def exp2_int(e):
    """Exact fp32 2**e for int32 e in [-149, 127] (subnormal results built from bits too)."""
    normal = (tl.maximum(e + 127, 1) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def e8m0_decode(byte):
    """E8M0 byte (uint8, or int32 0..255) -> fp32 2**(byte - 127) from bits: byte << 23 is that value for bytes
    1..254, byte 0 is the subnormal 2**-127 (bit 22). Byte 255 (NaN) is never written (it gives +inf here)."""
    b = byte.to(tl.int32) & 0xFF
    return ((b << 23) | tl.where(b == 0, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def pow2_f16(x):
    """int32 x <= 15 (any shape) -> fp16 2**x of that shape, exact (subnormal down to 2**-24; 0 below): the fp16
    form of exp2_int, for relative E8M0 block factors. Used by the index scorer (e8m0_word_factors, 2**(e - emax +
    14)) and by sparse attention (2**(e - e_tok) <= 1). Built as fp32 bits (0 below 2**-126) and converted, which
    rounds nothing above 2**-25 and that to 0 (ties to even): about a third of the instructions of assembling fp16's
    normal and subnormal bit patterns apart (sm_90: 57 -> 20 per tile of the Gluon sparse decode's factor pass)."""
    return ((tl.maximum(x, -127) + 127) << 23).to(tl.float32, bitcast=True).to(tl.float16)


@triton.jit
def e8m0_word_factors(words):
    """A token's four E8M0 scale bytes as one uint32 word [T] (byte k = block k, little-endian) -> (fp16 [T, 4]
    block factors 2**(e_k - emax + 14), NaN for byte 255; fp32 [T] 2**(emax - 14)), emax the token's largest
    exponent over its bytes other than 255 (byte 0 when all are 255): the same numbers as the index scorer's
    byte-wise path (a [T, NB] byte tile), computed once per token in a one-token-per-thread layout. Used by the
    index scorer (kernels/index_score.py) for mxfp4 keys with four scale blocks per token (D = 128)."""
    b0 = (words & 0xFF).to(tl.int32)
    b1 = ((words >> 8) & 0xFF).to(tl.int32)
    b2 = ((words >> 16) & 0xFF).to(tl.int32)
    b3 = (words >> 24).to(tl.int32)
    bmax = tl.maximum(tl.maximum(tl.where(b0 == 255, 0, b0), tl.where(b1 == 255, 0, b1)),
                      tl.maximum(tl.where(b2 == 255, 0, b2), tl.where(b3 == 255, 0, b3)))
    f0 = tl.where(b0 == 255, float("nan"), pow2_f16(b0 - bmax + 14))
    f1 = tl.where(b1 == 255, float("nan"), pow2_f16(b1 - bmax + 14))
    f2 = tl.where(b2 == 255, float("nan"), pow2_f16(b2 - bmax + 14))
    f3 = tl.where(b3 == 255, float("nan"), pow2_f16(b3 - bmax + 14))
    f16 = tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), [words.shape[0], 4])
    return f16, exp2_int(bmax - 141)  # 2**(emax - 14), emax = bmax - 127


@triton.jit
def e8m0_tile_factors(scales):
    """E8M0 scale bytes uint8 [T, N] (N block scales of a token, or a block scale gathered per element) -> (fp16
    [T, N] factors 2**(e - emax + 14), NaN for byte 255; fp32 [T] 2**(emax - 14)), emax the token's largest exponent
    (255 counts as -127): the token's largest block scale maps to 2**14, which times the 2**-14 of the decoded E2M1
    bits is 1; 2**emax multiplies the fp32 score instead. The same numbers as e8m0_word_factors, from a byte tile
    (through fp32 exp2_int, then one cast). Used by the index scorer for mxfp4 keys other than four blocks per token
    in words (the byte decode, and head dims other than 128)."""
    sbi = scales.to(tl.int32)
    e = tl.where(sbi == 255, -127, sbi - 127)
    emax = tl.max(e, axis=1)
    f16 = tl.where(sbi == 255, float("nan"), exp2_int(tl.maximum(e - emax[:, None] + 14, -149)))
    f16 = f16.to(tl.float16)
    rowfac = exp2_int(emax - 14)
    return f16, rowfac


@triton.jit
def mx_exponent(amax, RULE: tl.constexpr):
    """Unbiased E8M0 exponent (int32, clamped to [-127, 127]) of an fp32 block amax under a ScaleRule (see there)."""
    bits = amax.to(tl.int32, bitcast=True)
    if RULE == RULE_FLOOR:
        e = ((bits >> 23) & 0xFF) - 127 - 2
    elif RULE == RULE_EVEN:
        rounded = (bits + 0x200000) & 0x7F800000
        e = ((rounded >> 23) & 0xFF) - 127 - 2
    elif RULE == RULE_CEIL:
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32) - 2
    else:
        t = tl.math.div_rn(amax, tl.full(amax.shape, E2M1_MAX, tl.float32))
        tb = t.to(tl.int32, bitcast=True)
        normal_e = ((tb >> 23) & 0xFF) - 127 + ((tb & 0x7FFFFF) != 0).to(tl.int32)
        # subnormal t = m * 2**-149: ceil(log2 t) is -126 when m > 2**22, else <= -127 (clamped below)
        sub_e = tl.where((tb & 0x7FFFFF) > 0x400000, -126, -127)
        e = tl.where((tb & 0x7F800000) == 0, sub_e, normal_e)
    return tl.minimum(tl.maximum(e, -127), 127)


# ------------------------------------------------------------------------------------------------ block quantizers
@triton.jit
def zero_add(zero):
    """+0.0 where `zero`, else -0.0 (the torch codecs' zero-block add), built from bits: a -0.0 literal may lose its
    sign on the way to the kernel."""
    return ((zero == 0).to(tl.int32) << 31).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_quantize_block(x, RULE: tl.constexpr, low=7):
    """x: fp32 [R, NB, 32] -> (codes int32 [R, NB, 32], scale bytes uint8 [R, NB]). Mirrors formats.codecs.
    `low`: e2m1_encode's mask (7; kernels pass it at run time)."""
    amax = tl.max(tl.abs(x), axis=2)
    e = mx_exponent(amax, RULE)
    zero = amax == 0.0
    # As the torch codec: an all-zero block adds +0.0 (every -0 becomes +0: codes 0), the others -0.0 (no change).
    # The scaling by 2**-e and the add are one fma per element (x * 2**-e + -0.0 rounds like x * 2**-e).
    y = x * exp2_int(-e)[:, :, None] + zero_add(zero)[:, :, None]
    # |y| <= amax * 2**-e < 7 under every rule but floor (ceil: <= 4; even: < 1.75 * 4 without the round-up, <= 4
    # with it; rceil: <= 6 (1 + 2**-23)), so only floor needs the encoder's clamp at 6.
    codes = e2m1_encode(y, RULE == RULE_FLOOR, low)
    scale = tl.where(zero, 0, e + 127).to(tl.uint8)
    return codes, scale


@triton.jit
def nvfp4_scaled(x, s, g_dec, amax_6, RECIPE: tl.constexpr):
    """x fp32 [R, NB, 16], decoded E4M3 block scales s and amax / 6 [R, NB] -> x in units of its block scale, by the
    recipe: rcp x * RN(1 / (s g_dec)), div RN(x / (s g_dec)), unrounded RN(x / (amax / 6))."""
    if RECIPE == RECIPE_RCP:
        denom = s * g_dec
        y = x * tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)[:, :, None]
    elif RECIPE == RECIPE_DIV:
        denom = s * g_dec
        y = tl.math.div_rn(x, tl.broadcast_to(denom[:, :, None], x.shape))
    else:
        y = tl.math.div_rn(x, tl.broadcast_to(amax_6[:, :, None], x.shape))
    return y


@triton.jit
def nvfp4_quantize_block(x, g_dec, g_enc, RECIPE: tl.constexpr, NATIVE: tl.constexpr = False, low=7):
    """x: fp32 [R, NB, 16]; g_dec / g_enc: fp32 outer scales (decode, encode = fp32(1 / g_dec)) ->
    (codes int32 [R, NB, 16], scale bytes uint8 [R, NB]). Mirrors formats.codecs.nvfp4_quantize op by op.
    NATIVE: the scale byte through the hardware e4m3 conversion (see e4m3_encode).
    (The zero-scale rule stays a select on the codes here: the mxfp4 form, a +-0 add fused into the scaling fma,
    gave wrong bytes for nvfp4-rcp on the H200 with 4 blocks per thread (64 x 4 tiles), 2 blocks were right.)"""
    amax = tl.max(tl.abs(x), axis=2)
    amax_6 = tl.math.div_rn(amax, tl.full(amax.shape, E2M1_MAX, tl.float32))
    scale = e4m3_encode(amax_6 * g_enc, NATIVE)
    s = e4m3_decode(scale)
    y = nvfp4_scaled(x, s, g_dec, amax_6, RECIPE)
    codes = tl.where((scale == 0)[:, :, None], 0, e2m1_encode(y, True, low))
    return codes, scale


@triton.jit
def fp8_encode_scaled(x, s, NATIVE: tl.constexpr = False):
    """fp32 x / s (IEEE division) -> E4M3 byte: the fp8 `tensor` / `token` element step (NATIVE: see e4m3_encode)."""
    return e4m3_encode(tl.math.div_rn(x, s), NATIVE)


# ----------------------------------------------------------------------------- added for the store / dequant kernels
DS_AMAX_FLOOR = tl.constexpr(1e-4)  # DeepSeek V3.2 indexer floor on the row amax (formats.codecs.DS_AMAX_FLOOR)
INTERPRET = tl.constexpr(platform.INTERPRET)  # fixed at import, like every jit constant


@triton.jit
def fp8_row_scale(amax, DS_FLOOR: tl.constexpr, POW2: tl.constexpr):
    """fp32 amax -> fp32 fp8 scale `s`, as formats.codecs.fp8_row_scale: `amax / 448` (1 where that quotient is 0:
    amax 0, or an amax so small that the quotient underflows), or `max(amax, 1e-4) / 448` with DS_FLOOR, then with
    POW2 rounded up to `2**ceil(log2 s)` from the exponent bits."""
    if DS_FLOOR:
        s = tl.math.div_rn(tl.maximum(amax, DS_AMAX_FLOOR), tl.full(amax.shape, E4M3_MAX, tl.float32))
    else:
        s = tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))
        s = tl.where(s > 0, s, 1.0)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        s = exp2_int(((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32))
    return s


@triton.jit
def bf16_encode(x):
    """fp32 -> bf16, round half to even (torch's `.to(torch.bfloat16)`; NaN -> 0x7FC0 as on the CPU).

    Compiled, the native cast is already RNE (and packs two per instruction). The interpreter truncates instead, so
    there the rounding is done on the bits: add 0x7FFF plus the kept LSB, drop the low 16 bits."""
    if INTERPRET:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def bf16_decode(x):
    """bf16 tensor -> fp32, exactly, by bits (`bits << 16`). Compiled this is what the cast does anyway; the
    interpreter's bf16 -> fp32 cast garbles bf16 subnormals."""
    b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode_any(byte, NATIVE: tl.constexpr = False):
    """e4m3_decode for bytes kvtool did not write: the NaN codes 0x7F / 0xFF decode to NaN (torch float8_e4m3fn).
    NATIVE (launchers set it on CUDA sm_89+ only): the hardware fp8 -> fp32 conversion, exact, NaN codes to NaN."""
    if NATIVE:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = e4m3_decode(byte)
    return tl.where((byte.to(tl.int32) & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e8m0_decode_any(byte):
    """e8m0_decode for bytes kvtool did not write: byte 255 decodes to NaN (SPEC section 1). Bytes 0 and 255 (the
    ones with (byte + 1) & 0xFE == 0) get bit 22: 2**-127 and the quiet NaN 0x7FC00000 (6 integer ops, no fp select;
    exp2_int and a NaN select took ~8 a byte in the Gluon index scorer's loop)."""
    b = byte.to(tl.int32) & 0xFF
    return ((b << 23) | tl.where(((b + 1) & 0xFE) == 0, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_from_field(bits):
    """e8m0_decode_any of a byte already in place: int32 bits holding the byte in the fp32 exponent field (bits
    23-30) and zeros elsewhere -> fp32 2**(byte - 127), 2**-127 for byte 0, NaN for byte 255, in two ops and no
    select (e8m0_decode_any of a byte inside a wider word takes about eight): an integer max with 2**-127's bits
    (byte 0's 0.0 becomes 2**-127; the bits of non-negative floats order as the floats), then y * 0 + y turns byte
    255's inf into NaN and leaves every finite y. Needs subnormals kept (no flush to zero), as the multiplies by
    2**-127 do anyway."""
    y = tl.maximum(bits, 0x400000).to(tl.float32, bitcast=True)
    return tl.fma(y, 0.0, y)


# ------------------------------------------------------------------------ store engineer: cheaper block-scale steps
# Same bits as the helpers above, fewer instructions per block (the store kernels are issue-bound). Tests (exhaustive
# over the subnormal-quotient range for the rceil formula): tests/kernels/test_kernel_codecs.py, store engineer section.
@triton.jit
def mx_rceil_exponent(amax):
    """mx_exponent(amax, RULE_RCEIL) for finite fp32 amax >= 0 without the division, in integer ops.

    For amax = (1 + f) * 2**E: RN(amax / 6) <= 2**k exactly when amax <= 6 * 2**k (the fp32 neighbours of 6 * 2**k
    are further from it than the quotient's half ulp), so ceil(log2(RN(amax / 6))) = E - 2 + [f > 1/2]: adding
    0x3FFFFF carries into the exponent field exactly when the mantissa exceeds 0x400000, and the bias 129 goes into
    the same add. Below amax = 6 * 2**-126 the quotient is subnormal and the reference clamps to -126 / -127: the same
    formula clamped at -127 agrees except at amax = 0x01400001 (1.5 * 2**-125 + 2**-148), whose quotient rounds to
    2**-127 (a tie to even), exponent -127 where the formula says -126. amax = 0 gives -127 (byte 0: the zero-block
    byte without a select)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.maximum((bits + (0x3FFFFF - (129 << 23))) >> 23, -127)
    return tl.where(bits == 0x01400001, -127, e)


@triton.jit
def mxfp4_quantize_block_fast(x, RULE: tl.constexpr, low=7):
    """mxfp4_quantize_block (same codes and bytes) through mxfp4_scale_block (division-free rceil exponent)."""
    y, scale = mxfp4_scale_block(x, RULE)
    codes = e2m1_encode(y, RULE == RULE_FLOOR, low)
    return codes, scale


@triton.jit
def amax_div6(amax, BF16_AMAX: tl.constexpr = False):
    """RN(amax / 6) for an fp32 block amax. BF16_AMAX (the amax is a bf16 value, as in a store of bf16 rows; and the
    code is compiled, with a real fma: the interpreter's fma rounds twice): Markstein's q = RN(a RN(1/6)), r =
    fma(-q, 6, a), fma(r, RN(1/6), q), 3 instructions instead of the IEEE division's ~10 with its slow-path check.
    It equals RN(a / 6) for every bf16 a (tests/kernels/test_kernel_codecs.py checks all 32640 non-negative finite ones in
    exact arithmetic, and the GPU test on the device): the sequence is wrong only on exact ties of a subnormal
    quotient, and a / 6 of a bf16 a is never such a tie (a = m 2**-133 would need m 2**16 = 3 (2 j + 1))."""
    if BF16_AMAX:
        c = 0.16666667163372039795  # RN(1/6) = 0x3E2AAAAB, exact in fp32
        q = amax * c
        r = tl.fma(-q, 6.0, amax)
        return tl.fma(r, c, q)
    else:
        return tl.math.div_rn(amax, tl.full(amax.shape, E2M1_MAX, tl.float32))


@triton.jit
def nvfp4_quantize_block_fast(x, g_dec, g_enc, RECIPE: tl.constexpr, NATIVE: tl.constexpr = False, low=7,
                              BF16_AMAX: tl.constexpr = False, amax=None, rcp_lut=None):
    """nvfp4_quantize_block (same codes and bytes) with, under NATIVE (CUDA sm_89+, set by launchers), the stored E4M3
    scale decoded by the hardware conversion (exact; the saturating encoder never writes the NaN codes) instead of the
    integer decode: about 10 integer ops less per block. amax / 6: see amax_div6 (BF16_AMAX). Optional, from a caller
    that has them cheaper: `amax` [R, NB] (the block amax of x, fp32), and for the rcp recipe `rcp_lut`, a pointer to
    256 fp32 with entry b = RN(1 / RN(e4m3(b) g_dec)) (0 for b = 0; `rcp_table` computes it): one gather per block
    instead of the decode, the multiply and the IEEE reciprocal."""
    if amax is None:
        amax = tl.max(tl.abs(x), axis=2)
    amax_6 = amax_div6(amax, BF16_AMAX)
    v = amax_6 * g_enc
    scale = e4m3_encode(v, NATIVE)
    # the stored byte is 0 exactly when v <= 2**-10 (half the smallest E4M3 subnormal; the tie rounds to even, 0): the
    # zero-scale rule from v, not from the byte (with NATIVE, `byte == 0` gave wrong codes on the H200 in a test
    # kernel whose blocks span several lanes, while the bytes themselves were right)
    zero = v <= 0.0009765625
    if RECIPE == RECIPE_RCP and rcp_lut is not None:
        y = x * tl.load(rcp_lut + scale.to(tl.int32))[:, :, None]
    else:
        if NATIVE:
            s = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            s = e4m3_decode(scale)
        y = nvfp4_scaled(x, s, g_dec, amax_6, RECIPE)
    codes = tl.where(zero[:, :, None], 0, e2m1_encode(y, True, low))
    return codes, scale


@triton.jit
def rcp_table(out_ptr, g_dec):
    """The nvfp4 rcp recipe's per-block reciprocal for every scale byte b: out[b] = RN(1 / RN(e4m3(b) g_dec)) by the
    same ops as nvfp4_scaled (0 for b = 0, whose blocks encode to 0; the NaN bytes, never written, get 0 too). One
    program of 256 lanes; kernels that gather from it (nvfp4_quantize_block_fast's rcp_lut) give the same bytes."""
    b = tl.arange(0, 256)
    d = e4m3_decode(b) * g_dec
    r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    mag = b & 0x7F
    tl.store(out_ptr + b, tl.where((mag == 0) | (mag == 0x7F), 0.0, r))


# --------------------------------------------------------- store engineer: scaled values -> payload words (ALU relief)
# The 4-bit store kernels are bound by Hopper's ALU pipe (LOP3 / SHF / FMNMX issue at half rate; FFMA / IMAD go to the
# FMA pipes). These helpers give the same bytes as *_quantize_block + pack_nibble_words with the sign, the nibble mask
# and the pack on the multiply pipe: sign = umulhi(bits, 2) (bit 31), magnitude = the fma sum's bits minus its
# exponent 0x4B000000 (folded into one constant per word), shifts as multiplies by powers of 16.
E2M1_T_BITS = tl.constexpr(0x4B000000)  # bits of 2**23: e2m1_encode's sum is 2**23 + code
E2M1_T_WORD = tl.constexpr(0xFB000000)  # 0x4B000000 * 0x11111111 mod 2**32: the 8 nibbles' exponent words summed


@triton.jit
def e2m1_words(y, ROWS: tl.constexpr, COLS: tl.constexpr, SATURATE: tl.constexpr = True):
    """fp32 y [ROWS, COLS] -> int32 words [ROWS, COLS // 8] of E2M1 codes (e2m1_encode(y) nibbles, element 8i + k in
    nibble k of word i: the pack_nibble_words layout), RNE at ties, -0 -> code 8, saturating at 6 if SATURATE.

    Same magnitude sum as e2m1_encode (t = 2**23 + code, exact); v = bits(t) + 8 * sign, where sign = bits(y) >> 31
    taken as the high word of bits * 2 (an IMAD.HI, not an ALU shift); the 8 values of a word are summed as
    v_k * 16**k modulo 2**32 (disjoint nibbles once the exponent part is removed), and the 8 exponent parts
    0x4B000000 * 16**k come off as one constant."""
    m = tl.abs(y)
    t = tl.minimum(m * 2.0 + 8388608.0, m + 8388610.0)  # 2**23, 2**23 + 2
    t = tl.minimum(t, m * 0.5 + 8388612.0)  # 2**23 + 4
    if SATURATE:
        t = tl.minimum(t, 8388615.0)  # code 7 (6.0)
    sign = tl.umulhi(y.to(tl.uint32, bitcast=True), tl.full(y.shape, 2, tl.uint32))
    v = t.to(tl.uint32, bitcast=True) + sign * 8
    c = tl.reshape(v, [ROWS, COLS // 8, 2, 2, 2])  # k = 4 k2 + 2 k1 + k0, k0 innermost
    even, odd = tl.split(c)
    b = even + odd * 16
    lo, hi = tl.split(b)
    h = lo + hi * 256
    lo, hi = tl.split(h)
    w = lo + hi * 65536 - E2M1_T_WORD
    return w.to(tl.int32, bitcast=True)


@triton.jit
def mxfp4_scale_block(x, RULE: tl.constexpr):
    """x: fp32 [R, NB, 32] -> (y fp32 [R, NB, 32], scale bytes uint8 [R, NB]): the mxfp4 block codec up to the element
    encode, with the rceil exponent from mx_rceil_exponent (no division) and the zero-block byte from the exponent
    itself where the rule gives -127 for amax 0 (rceil); y = x * 2**-e + (+0 on all-zero blocks, else -0), and
    e2m1_encode(y, RULE == RULE_FLOOR) gives its codes."""
    amax = tl.max(tl.abs(x), axis=2)
    zero = amax == 0.0
    if RULE == RULE_RCEIL:
        e = mx_rceil_exponent(amax)
        scale = (e + 127).to(tl.uint8)  # amax 0 -> e = -127 -> byte 0
    else:
        e = mx_exponent(amax, RULE)
        scale = tl.where(zero, 0, e + 127).to(tl.uint8)
    y = x * exp2_int(-e)[:, :, None] + zero_add(zero)[:, :, None]
    return y, scale


@triton.jit
def nvfp4_scale_block(x, g_dec, g_enc, RECIPE: tl.constexpr, NATIVE: tl.constexpr = False,
                      BF16_AMAX: tl.constexpr = False):
    """x: fp32 [R, NB, 16] -> (y fp32 [R, NB, 16], scale bytes uint8 [R, NB]): nvfp4_quantize_block_fast up to the
    element encode, with the zero-scale rule folded into y: e2m1_encode(y, True) gives its codes.

    rcp recipe: the per-block reciprocal is set to 0 on zero-scale blocks and y = x * r + (+0 there, else -0), one fma
    (x * r + -0.0 rounds like x * r, -0 included), so zero-scale blocks encode to codes 0 without a select per
    element (a reciprocal of 1 / 0 = inf left in would give inf / NaN codes). div / unrounded: a select on y."""
    amax = tl.max(tl.abs(x), axis=2)
    amax_6 = amax_div6(amax, BF16_AMAX)
    v = amax_6 * g_enc
    scale = e4m3_encode(v, NATIVE)
    zero = v <= 0.0009765625  # the stored byte is 0 (see nvfp4_quantize_block_fast)
    if NATIVE:
        s = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        s = e4m3_decode(scale)
    if RECIPE == RECIPE_RCP:
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s * g_dec)
        r = tl.where(zero, 0.0, r)
        y = x * r[:, :, None] + zero_add(zero)[:, :, None]
    else:
        if RECIPE == RECIPE_DIV:
            y = tl.math.div_rn(x, tl.broadcast_to((s * g_dec)[:, :, None], x.shape))
        else:
            y = tl.math.div_rn(x, tl.broadcast_to(amax_6[:, :, None], x.shape))
        y = tl.where(zero[:, :, None], 0.0, y)
    return y, scale


@triton.jit
def fp4_quantize_blocks(xb, g_dec, g_enc, E8M0: tl.constexpr, RULE: tl.constexpr, RECIPE: tl.constexpr,
                        NATIVE: tl.constexpr, FAST: tl.constexpr, low=7, BF16_AMAX: tl.constexpr = False, amax=None,
                        rcp_lut=None):
    """fp32 [R, NB, B] -> (codes int32 [R, NB, B], scale bytes uint8 [R, NB]) by one FP4 block codec: mxfp4 (E8M0:
    B = 32, RULE) or nvfp4 (B = 16, RECIPE, outer scale g_dec / g_enc); FAST picks the *_quantize_block_fast form
    (same bytes, see the store kernels' FAST_CODECS); BF16_AMAX: see amax_div6; amax, rcp_lut (fast nvfp4 only):
    see nvfp4_quantize_block_fast."""
    if E8M0:
        if FAST:
            codes, sbytes = mxfp4_quantize_block_fast(xb, RULE, low)
        else:
            codes, sbytes = mxfp4_quantize_block(xb, RULE, low)
    else:
        if FAST:
            codes, sbytes = nvfp4_quantize_block_fast(xb, g_dec, g_enc, RECIPE, NATIVE, low, BF16_AMAX, amax, rcp_lut)
        else:
            codes, sbytes = nvfp4_quantize_block(xb, g_dec, g_enc, RECIPE, NATIVE, low)
    return codes, sbytes


@triton.jit
def fp4_scaled_words(xb, g_dec, g_enc, E8M0: tl.constexpr, RULE: tl.constexpr, RECIPE: tl.constexpr,
                     NATIVE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BF16_AMAX: tl.constexpr = False):
    """xb: fp32 [ROWS, COLS / B, B] -> (payload words int32 [ROWS, COLS / 8], scale bytes uint8 [ROWS, COLS / B]):
    one FP4 block codec on the multiply-pipe path: mxfp4 (E8M0: B = 32, RULE) or nvfp4 (B = 16, RECIPE, outer scale
    g_dec / g_enc) block scales, then e2m1_words (saturating, except mxfp4 FLOOR whose codes cannot overflow)."""
    if E8M0:
        y, scale = mxfp4_scale_block(xb, RULE)
        words = e2m1_words(tl.reshape(y, [ROWS, COLS]), ROWS, COLS, RULE == RULE_FLOOR)
    else:
        y, scale = nvfp4_scale_block(xb, g_dec, g_enc, RECIPE, NATIVE, BF16_AMAX)
        words = e2m1_words(tl.reshape(y, [ROWS, COLS]), ROWS, COLS, True)
    return words, scale
