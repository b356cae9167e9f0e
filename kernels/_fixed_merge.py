"""The merges of split partial sums, shared by the kernels whose programs split a dot product
and meet on the output (decode_attention_proj's heads, the decode GEMV's K chunks and groups).

_add_stored: each program stores its fp32 partial and counts its arrival; the last to arrive
reads the partials back and adds them in a fixed order (the same bits in every launch).

_launch_number and _add_unfenced, the unfenced merge (the stored merge's order and bits, two
round trips after the products where it takes three: no fence). A block's programs meet at an
int64 counter that only counts up, PARTS a launch; before its products a program reads it
(which launch this is: count // PARTS, the same whether or not others of the launch have counted
yet). Its partial goes to the buffer of the launch's parity, and EMPTY (a signalling NaN's bits,
which no arithmetic result has) to its part of the other buffer, for the next launch; then it
counts itself in by a relaxed atomic, and the last to count reads the parts back (again, while
one still reads EMPTY: a store not yet seen, rare, from a program that has counted, and so is
running) and adds them in order. Nothing waits for a store to land but the reader.

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
EMPTY = tl.constexpr(0x7FBADBAD)  # the unfenced merge's empty element: a signalling NaN's bits


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
def _launch_number(count_ptr, PARTS: tl.constexpr):
    """This launch's number at its block's counter (int64, counting up, PARTS a launch). Read it
    after the inputs' wait: every program of the previous launch on the counter has counted."""
    return tl.load(count_ptr, volatile=True) // PARTS


@triton.jit
def _add_unfenced(acc, part, count_ptr, launch, part_id, tile_mask, part_stride, PARTS: tl.constexpr):
    """Stores this program's partial acc as part part_id of launch `launch` (part: the block's
    two buffers of PARTS parts, part_stride apart), empties its part of the next launch's buffer
    and counts it in at count_ptr. Returns (the parts' sum in order from zero, True) to the last
    of the PARTS to count (_add_stored's arithmetic and bits), (acc, False) to the others."""
    here = part + (launch % 2) * PARTS * part_stride + part_id * part_stride
    ahead = part + ((launch + 1) % 2) * PARTS * part_stride + part_id * part_stride
    tl.store(here, acc, mask=tile_mask)
    tl.store(ahead.to(tl.pointer_type(tl.int32)), tl.full(acc.shape, EMPTY, tl.int32), mask=tile_mask)
    last = tl.atomic_add(count_ptr, 1, sem="relaxed") % PARTS == PARTS - 1  # no fence: EMPTY marks the unseen
    if last:
        parts = part + (launch % 2) * PARTS * part_stride
        total, unseen = _gather_parts(acc, parts, tile_mask, part_stride, PARTS, False)
        while unseen > 0:
            total, unseen = _gather_parts(acc, parts, tile_mask, part_stride, PARTS, True)
        acc = total
    return acc, last


@triton.jit
def _gather_parts(acc, parts, tile_mask, part_stride, PARTS: tl.constexpr, AGAIN: tl.constexpr):
    """The parts in order from zero (as _add_stored), and how many of their elements read EMPTY.
    One count at the end: a reduction a part would put a barrier, and with it a round trip,
    between their loads. AGAIN: volatile loads, which a loop cannot hoist."""
    total = tl.zeros_like(acc)
    unseen = tl.zeros(acc.shape, tl.int32)
    for s in tl.static_range(PARTS):
        if AGAIN:
            value = tl.load(parts + s * part_stride, mask=tile_mask, other=0.0, volatile=True)
        else:
            value = tl.load(parts + s * part_stride, mask=tile_mask, other=0.0, cache_modifier=".cg")
        unseen += (value.to(tl.int32, bitcast=True) == EMPTY).to(tl.int32)
        total += value
    return total, tl.sum(unseen)


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
