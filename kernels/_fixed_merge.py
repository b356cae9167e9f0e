"""The merges of split partial sums, shared by the kernels whose programs split a dot product
and meet on the output (decode_attention_proj's heads, the decode GEMV's K chunks and groups).

_add_stored: each program stores its fp32 partial and counts its arrival; the last to arrive
reads the partials back and adds them in a fixed order (the same bits in every launch).

_take_ticket and _add_tagged, the tagged merge (the stored merge's order and bits, one round
trip after the products where it took three): each program takes a ticket from its block's
int64 counter, which only counts up, as soon as its inputs are ready, before its products. The
ticket says which launch this is (ticket // PARTS + 1, the tag) and whether the program came
last. The others store their fp32 partials each beside the tag, in one 64-bit word (a single
store: the value and its tag arrive together), and are done. The last adds the parts in order,
reading each word until it bears this launch's tag: it waits only for programs that took their
tickets before it, and so are running, never for one not yet scheduled. No fence, no second
atomic, nothing to reset: a word of an earlier launch bears a smaller tag.

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
def _take_ticket(tickets, PARTS: tl.constexpr):
    """This program's ticket at its block's counter (int64, counting up): (the launch's tag,
    whether it came last of the PARTS). Take it after the inputs' wait, so that every program of
    the previous launch on these counters has taken its own."""
    ticket = tl.atomic_add(tickets, 1, sem="relaxed")  # relaxed: the tags order the data
    return ticket // PARTS + 1, ticket % PARTS == PARTS - 1


@triton.jit
def _add_tagged(acc, words, part_id, tag, last, tile_mask, part_stride, PARTS: tl.constexpr):
    """With _take_ticket's (tag, last): stores this program's partial acc as part part_id (at
    words + part_id * part_stride, tagged) and returns (acc, False); or, to the last, the parts'
    sum in order from zero (_add_stored's bits) and True."""
    if last:
        total, missing = _gather_tagged(acc, words, part_id, tag, tile_mask, part_stride, PARTS)
        while missing > 0:  # a part not stored yet (its program still at its products): read again
            total, missing = _gather_tagged(acc, words, part_id, tag, tile_mask, part_stride, PARTS)
        acc = total
    else:
        bits = acc.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended: the tag's half stays clear
        tl.store(words + part_id * part_stride, (tag.to(tl.int64) << 32) | bits, mask=tile_mask)
    return acc, last


@triton.jit
def _tagged_word(words, s: tl.constexpr, part_id, tag, tile_mask, part_stride, PARTS: tl.constexpr):
    """Part s's words; where masked or part_id's own, the tag alone (a ready +0.0), and past the
    last part a placeholder."""
    if s < PARTS:
        other = tile_mask & (tl.full(tile_mask.shape, s, tl.int32) != part_id)  # (the interpreter wants a tile)
        return tl.load(words + s * part_stride, mask=other, other=tag.to(tl.int64) << 32, volatile=True)  # not L1
    else:
        return tl.zeros(tile_mask.shape, tl.int64)


@triton.jit
def _add_word(total, stale, acc, word, s: tl.constexpr, part_id, tag, PARTS: tl.constexpr):
    """total + part s (acc where it is part_id's own), and stale + where its words lack the tag."""
    if s < PARTS:
        total += tl.where(part_id == s, acc, word.to(tl.int32).to(tl.float32, bitcast=True))
        stale += ((word >> 32) != tag).to(tl.int32)
    return total, stale


@triton.jit
def _gather_tagged(acc, words, part_id, tag, tile_mask, part_stride, PARTS: tl.constexpr):
    """The parts in order from zero (acc as part part_id), and how many of the others' words
    do not bear tag yet. Every part's words are loaded before any is used (named, at most
    MAX_TAGGED_PARTS): each part's layout conversion before the next part's load put a
    barrier, and with it a round trip, between them."""
    w0 = _tagged_word(words, 0, part_id, tag, tile_mask, part_stride, PARTS)
    w1 = _tagged_word(words, 1, part_id, tag, tile_mask, part_stride, PARTS)
    w2 = _tagged_word(words, 2, part_id, tag, tile_mask, part_stride, PARTS)
    w3 = _tagged_word(words, 3, part_id, tag, tile_mask, part_stride, PARTS)
    total = tl.zeros_like(acc)
    stale = tl.zeros(acc.shape, tl.int32)
    total, stale = _add_word(total, stale, acc, w0, 0, part_id, tag, PARTS)
    total, stale = _add_word(total, stale, acc, w1, 1, part_id, tag, PARTS)
    total, stale = _add_word(total, stale, acc, w2, 2, part_id, tag, PARTS)
    total, stale = _add_word(total, stale, acc, w3, 3, part_id, tag, PARTS)
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
