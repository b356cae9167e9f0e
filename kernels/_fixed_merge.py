"""The merges of split partial sums, shared by the kernels whose programs split a dot product
and meet on the output (decode_attention_proj's heads, the decode GEMV's K chunks and groups).

_add_stored: each program stores its fp32 partial and counts its arrival; the last to arrive
reads the partials back and adds them in a fixed order (the same bits in every launch).

_launch_tag and _add_tagged, the tagged merge (the stored merge's order and bits, two round
trips after the products where it took three): a block's programs meet at an int64 counter that
only counts up, PARTS a launch. Before its products a program reads it: which launch this is
(the tag: count // PARTS + 1, the same whether or not others of the launch have counted yet).
After them it stores its fp32 partial beside the tag, in one 64-bit word (a single store: the
value and its tag arrive together), and counts itself in without a fence (a relaxed atomic, one
round trip). The last to count reads the parts' words back, again until each bears the tag
(a store not yet seen: rare, and its program has counted, so it is running), and adds them in
order. Nothing is reset: a word of an earlier launch bears a smaller tag.

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
MAX_TAGGED_PARTS = 4  # _gather_tagged's named loads


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
def _launch_tag(tickets, PARTS: tl.constexpr):
    """This launch's tag at its block's counter (int64, PARTS a launch). Read it after the
    inputs' wait: every program of the previous launch on these counters has counted by then."""
    return tl.load(tickets, volatile=True) // PARTS + 1


@triton.jit
def _add_tagged(acc, words, tickets, part_id, tag, tile_mask, part_stride, PARTS: tl.constexpr):
    """Stores this program's partial acc as part part_id (at words + part_id * part_stride, in
    words that bear tag) and counts it in at tickets. Returns (the parts' sum in order from zero,
    True) to the last of the PARTS to count (_add_stored's arithmetic and bits), (acc, False) to
    the others."""
    bits = acc.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended: the tag's half stays clear
    tl.store(words + part_id * part_stride, (tag.to(tl.int64) << 32) | bits, mask=tile_mask)
    last = tl.atomic_add(tickets, 1, sem="relaxed") % PARTS == PARTS - 1  # relaxed: the tags order the data
    if last:
        total, missing = _gather_tagged(acc, words, tag, tile_mask, part_stride, PARTS)
        while missing > 0:  # a part not seen yet (rare): read them again
            total, missing = _gather_tagged(acc, words, tag, tile_mask, part_stride, PARTS)
        acc = total
    return acc, last


@triton.jit
def _tagged_word(words, s: tl.constexpr, tag, tile_mask, part_stride, PARTS: tl.constexpr):
    """Part s's words (masked: the tag alone, a ready +0.0), a placeholder past the last part."""
    if s < PARTS:
        return tl.load(words + s * part_stride, mask=tile_mask, other=tag.to(tl.int64) << 32, volatile=True)
    else:
        return tl.zeros(tile_mask.shape, tl.int64)


@triton.jit
def _add_word(total, stale, word, s: tl.constexpr, tag, PARTS: tl.constexpr):
    """total + part s's values, and stale + where its words lack the tag."""
    if s < PARTS:
        total += word.to(tl.int32).to(tl.float32, bitcast=True)
        stale += ((word >> 32) != tag).to(tl.int32)
    return total, stale


@triton.jit
def _gather_tagged(acc, words, tag, tile_mask, part_stride, PARTS: tl.constexpr):
    """The parts' sum in order from zero, and how many of their words do not bear tag yet.
    Every part is loaded before any is used (named, at most MAX_TAGGED_PARTS): a part's use
    (its reduction, its layout's conversion) before the next part's load put a barrier, and
    with it a round trip, between them."""
    w0 = _tagged_word(words, 0, tag, tile_mask, part_stride, PARTS)
    w1 = _tagged_word(words, 1, tag, tile_mask, part_stride, PARTS)
    w2 = _tagged_word(words, 2, tag, tile_mask, part_stride, PARTS)
    w3 = _tagged_word(words, 3, tag, tile_mask, part_stride, PARTS)
    total = tl.zeros_like(acc)
    stale = tl.zeros(acc.shape, tl.int32)
    total, stale = _add_word(total, stale, w0, 0, tag, PARTS)
    total, stale = _add_word(total, stale, w1, 1, tag, PARTS)
    total, stale = _add_word(total, stale, w2, 2, tag, PARTS)
    total, stale = _add_word(total, stale, w3, 3, tag, PARTS)
    return total, tl.sum(stale)


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
