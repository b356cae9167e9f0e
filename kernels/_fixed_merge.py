"""The merges of split partial sums, shared by the kernels whose programs split a dot product
and meet on the output (decode_attention_proj's heads, the decode GEMV's K chunks and groups).

_add_stored: each program stores its fp32 partial and counts its arrival; the last to arrive
reads the partials back and adds them in a fixed order (the same bits in every launch).

_add_fixed, the one-atomic merge:
Each program adds its fp32 partial to one int64 word per output element, in fixed point (units
of 2**-24), with an arrival count in the same word, by one atomic that returns the word. Integer
sums do not depend on the order. The program that brings an element's count to the number of
parts holds the element's whole sum and finishes it (its epilogue), then zeroes the word for the
next launch. Storing partials, passing an arrival counter and reading the partials back took
three round trips; this is one.

A word: bits 0-51 the partials, each in units of 2**-24 and raised by FIXED_OFFSET (so each
adds less than 2**46, and up to 63 parts stay below bit 52); bits 52-57 the parts that arrived;
bits 58-63 the parts whose partial was not finite or not below FIXED_LIMIT (the element comes
out NaN then).
"""
import triton
import triton.language as tl

FIXED_SCALE = tl.constexpr(float(1 << 24))
FIXED_UNIT = tl.constexpr(1.0 / FIXED_SCALE.value)
FIXED_OFFSET = tl.constexpr(1 << 45)
FIXED_LIMIT = tl.constexpr(FIXED_OFFSET.value / FIXED_SCALE.value)  # 2**21
ARRIVE_SHIFT = tl.constexpr(52)
UNFIT_SHIFT = tl.constexpr(58)
ARRIVAL = tl.constexpr(1 << ARRIVE_SHIFT.value)
UNFIT = tl.constexpr(1 << UNFIT_SHIFT.value)
SUMS_MASK = tl.constexpr(ARRIVAL.value - 1)
ARRIVE_MASK = tl.constexpr((1 << (UNFIT_SHIFT.value - ARRIVE_SHIFT.value)) - 1)  # the count's 6 bits
MAX_FIXED_PARTS = ARRIVE_MASK.value


@triton.jit
def _add_fixed(part, words, mask, PARTS: tl.constexpr):
    """Adds this program's partial (any shape) into its elements' fixed-point words (one
    returning atomic each). Returns the elements' sums, in fp32, and which of them this program
    completed: those where it was the PARTS-th to arrive (the sums of the others lack parts:
    mask them); it leaves their words zero for the next launch."""
    fits = tl.abs(part) < FIXED_LIMIT  # False for NaN and inf too
    units = (tl.where(fits, part, 0.0) * FIXED_SCALE).to(tl.int64)  # exact scaling, then truncation
    word = tl.where(fits, units + (FIXED_OFFSET + ARRIVAL), ARRIVAL + UNFIT)
    total = tl.atomic_add(words, word, mask=mask, sem="relaxed") + word
    done = mask & (((total >> ARRIVE_SHIFT) & ARRIVE_MASK) == PARTS)
    tl.store(words, tl.zeros_like(total), mask=done)  # after our atomic on the same word: in order
    field = (total & SUMS_MASK) - PARTS * FIXED_OFFSET
    sums = field.to(tl.float32) * FIXED_UNIT  # one rounding; the scaling is exact
    return tl.where((total >> UNFIT_SHIFT) != 0, float("nan"), sums), done


@triton.jit
def _add_stored(acc, part, count_ptr, part_id, tile_mask, part_stride, PARTS: tl.constexpr, PER: tl.constexpr):
    """Stores this program's partial acc as part part_id (at part + part_id * part_stride, fp32)
    and counts its arrival at count_ptr. Returns (the sum, True) to the last of the PARTS to
    arrive, which adds the parts in order, PER at a time into group sums (in order from zero),
    the group sums in order from zero, and leaves the counter at zero for the next launch;
    (acc, False) to the others."""
    tl.store(part + part_id * part_stride, acc, mask=tile_mask)
    # acq_rel: our partial is visible before the count moves; the last arriver sees all
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    finish = arrived == PARTS - 1
    if finish:
        acc = tl.zeros_like(acc)
        if PER >= PARTS:  # one group (0 + x is x): the partials in order
            for s in tl.static_range(PARTS):
                acc += tl.load(part + s * part_stride, mask=tile_mask, other=0.0, cache_modifier=".cg")
        else:
            for g in tl.static_range((PARTS + PER - 1) // PER):
                group = tl.zeros_like(acc)
                for j in tl.static_range(PER):
                    if g * PER + j < PARTS:
                        group += tl.load(part + (g * PER + j) * part_stride, mask=tile_mask, other=0.0,
                                         cache_modifier=".cg")
                acc += group
        # ready for the next launch (and graph replay), which the kernel boundary orders after
        # this one: relaxed, so the epilogue's stores need not wait for its round trip
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
    return acc, finish
