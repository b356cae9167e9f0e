"""A sampled decode step's logits processing and draw for top-k sampling, in one or two launches.

transformers' processors in its order (repetition penalty, temperature, top-k, top-p), its
softmax, and the draw argmax(p / q) with q ~ Exp(1), the draw torch.multinomial makes. q is
the (B, V) tensor torch's exponential_ fills, or, on CUDA, those values computed at the drawn
columns only from the generator's state (kernels/noise.py): the random stream is the one
transformers consumes either way. In torch the same work is about twenty kernels a step (topk's
radix passes, a sort for top-p, softmax, argmax, the NaN test), most of them one block per row
over the whole vocabulary: 112 us a call at gpt2 batch 1 on an H200 (196 with top-p), 22-25 here.

One program per (tile, row):
- _tile_candidates: the processed scores of BLOCK_V columns, a cut with at least k of them at
  or above it and, where ties allow, at most K_TILE (a bit-by-bit search of their ordered words,
  _kth_search), and the columns above the cut, then those at it, listed as (value, column) keys
  while K_TILE slots last. Also whether the tile has a NaN or +inf score, and whether ties at
  its cut were left unlisted.
- _draw_row, up to MAX_MERGED_ROWS rows in the row's last program to arrive (an arrival
  counter, as gemv.py's split-K), else in a second launch of one program a row: the k-th
  largest score of the tiles' lists is the row's, exactly (every tile listed at least its k
  largest). Kept are all scores >= it; ties stay, since transformers masks `scores < kth`.
  With top-p, the K_TILE largest keys (sorted) give the kept scores' running sums; without, the
  same search over the lists' words gives the k-th, between the largest cut and the largest
  score. The draw runs over the survivors, reading q at their columns only.
Both launch with programmatic dependent launch, as every decode kernel: each waits at its start
for the kernel before it.

Ties at the k-th value that some list left out (a tile's cut equal to it with ties unlisted, or
the row's list full of them) send the row to a scan: its ties are counted, and drawn among in a
second pass (slow, exact; a constant row gets there). Ties that top-p splits are dropped lowest
column first, as a stable ascending sort orders them (transformers' torch.sort on CUDA).

The sums (softmax's, top-p's) add in another order than torch's, so a draw can differ from
transformers' where two candidates' p / q lie within a rounding of each other, or a running
sum within one of 1 - top_p.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._libdevice import expf
from ._tuning import INTERPRET, launch, use_pdl
from ._workspace import arrival_counters
from .argmax_key import _argmax_key, _empty_keys, _from_ordered, _key_index, _ordered
from .kth_search import _kth_search, _ordered_of, _words
from .noise import ExponentialNoise, _exponential_at, check_noise

MAX_TOP_K = 128  # larger top_k (and top_k = 0, all of the vocabulary) run in torch
# columns per candidate tile (the interpreter's are smaller): with top-p the row sorts its tiles'
# listed keys, and wider tiles halve them. us a call at top_k 50, gpt2's vocabulary, on an H200
# (bench/results/h200/sampler.md, thirty-sixth session): top_p 0.95 at batch 8 28.7 -> 18.1,
# batch 1 and 64 even; without top-p, 4,096 columns lose 2-13 us
BLOCK_V = 512 if INTERPRET else 2048
BLOCK_V_TOP_P = 512 if INTERPRET else 4096
# num_warps by stage. The tile programs' search is a chain of reductions over the tile: at one
# launch (up to MAX_MERGED_ROWS rows) 16 warps wait least; with more rows the tiles outnumber
# the SMs, and fewer warps fit more programs on one: batch 8 18.7 us at 8 warps (20.4 at 16),
# batch 64 49.6 at 4 (57.6 at 8, 69.2 at 16)
LIST_WARPS_ROWS = 16  # the tile launch: 8 warps up to this many rows, 4 beyond


# the draw by each row's last tile program (one launch) up to this many rows, else a second
# launch draws. us a call at top_k 50 on an H200, one launch against two (both with dependent
# launch; bench/results/h200/sampler.md): batch 1 19.4 against 20.7, batch 4 19.6 / 20.9, batch 8
# 28.5 / 28.3, batch 64 126.8 / 114.5. Re-timed with the counting tiles: 8 rows even (18.5
# against 18.7 us), 16 rows slower (25.9 against 25.4)
MAX_MERGED_ROWS = 4
STAGES = {"merged": 0, "lists": 1, "draw": 2}


@triton.jit
def _processed(logits_ptr, seen_ptr, cols, valid, penalty, temperature, HAS_PENALTY: tl.constexpr):
    """fp32 scores of a tile of logits after the repetition penalty and the temperature, as
    transformers computes them (IEEE divisions), and the mask of those softmax has no probability
    for: NaN, and +inf (a temperature or penalty too small for the logits), where transformers'
    draw raises."""
    x = tl.load(logits_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_PENALTY:
        seen = tl.load(seen_ptr + cols, mask=valid, other=0) != 0
        x = tl.where(seen, tl.where(x < 0, x * penalty, tl.div_rn(x, penalty)), x)
    s = tl.div_rn(x, temperature)
    return s, ((s != s) | (s == float("inf"))) & valid


@triton.jit
def _decode(keys):
    """(value, column) of candidate keys: ordered(value) << 32 | column."""
    return _from_ordered((keys >> 32).to(tl.int32)), (keys & 4294967295).to(tl.int32)


@triton.jit
def _tile_candidates(logits_ptr, seen_ptr, cand_ptr, flags_ptr, cut_ptr, t, b, V, NT, k, penalty, temperature,
                     HAS_PENALTY: tl.constexpr, BLOCK_V: tl.constexpr, K_TILE: tl.constexpr):
    """Tile t of row b (logits_ptr, seen_ptr at the row): its list of candidate keys, flags and
    cut (an _ordered word)."""
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    s, nan = _processed(logits_ptr, seen_ptr, cols, valid, penalty, temperature, HAS_PENALTY)
    ok = valid & ~nan
    w = _ordered(s)
    u = _words(w)
    n_ok = tl.sum(ok.to(tl.int32), axis=0)
    cut = tl.full((), 0, tl.uint32)  # below every score's word: a tile of at most K_TILE lists them all
    n = n_ok
    if n_ok > K_TILE:  # (so n_ok > k) at least k scores at or above the cut, at most K_TILE unless tied
        lo = tl.min(tl.where(ok, u, 4294967295), axis=0)
        hi = tl.max(tl.where(ok, u, 0), axis=0)
        cut, n = _kth_search(u, ok, k, lo, hi, n_ok, K_TILE)
    # above: at most K_TILE, all listed first. Ties (a search that ran to the tile's k-th
    # largest) after them while slots last, lowest columns first
    above = ok & (u > cut)
    tie = ok & (u == cut)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    slot = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0), n_above + tl.cumsum(tie.to(tl.int32), axis=0)) - 1
    listed = (above | tie) & (slot < K_TILE)
    base = cand_ptr + (b * NT + t) * K_TILE
    tl.store(base + slot, (w.to(tl.int64) << 32) | cols.to(tl.int64), mask=listed)
    slots = tl.arange(0, K_TILE)
    tl.store(base + slots, _empty_keys(K_TILE), mask=slots >= n)  # a tile with fewer columns than slots
    # bit 0: a NaN or +inf score in the tile; bit 1: ties at the cut left unlisted
    tl.store(flags_ptr + b * NT + t, tl.max(nan.to(tl.int32), axis=0) | (n > K_TILE).to(tl.int32) * 2)
    tl.store(cut_ptr + b * NT + t, _ordered_of(cut))


@triton.jit
def _noise_at(q_ptr, row_start, cols, mask, noise_threads, IN_KERNEL: tl.constexpr):
    """q at a row's columns: torch's exponential_ values computed here (q_ptr is the generator
    state; row_start the row's first element) or read from the q tensor."""
    if IN_KERNEL:
        q = _exponential_at(q_ptr, row_start + cols, noise_threads)
    else:
        q = tl.load(q_ptr + cols, mask=mask, other=1.0)
    return q


@triton.jit
def _draw_row(logits_ptr, seen_ptr, q_ptr, cand_ptr, flags_ptr, cut_ptr, b, V, NT, k, penalty, temperature,
              drop_mass, noise_threads, HAS_PENALTY: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_C: tl.constexpr,
              NT_POW2: tl.constexpr, K_TILE: tl.constexpr, BLOCK_V: tl.constexpr, NOISE: tl.constexpr):
    """Row b's token id from its tiles' lists (logits_ptr, seen_ptr and q_ptr at the row); V for
    a row with a NaN. The lists come from other programs of this launch: read from L2 (.cg)."""
    row_start = b * V  # int32: with NOISE, B x V < 2^31
    c = tl.arange(0, BLOCK_C)
    keys = tl.load(cand_ptr + b * NT * K_TILE + c, mask=c < NT * K_TILE, other=0, cache_modifier=".cg")
    keys = tl.where(c < NT * K_TILE, keys, _empty_keys(BLOCK_C))
    if HAS_TOP_P:  # top-p sums the kept scores in order: the row's K_TILE largest keys, sorted
        keys = tl.topk(keys, K_TILE)
        r = tl.arange(0, K_TILE)
        empty = _empty_keys(K_TILE)
    else:  # the whole lists stay, unordered
        r = c
        empty = _empty_keys(BLOCK_C)
    listed = keys != empty
    v, col = _decode(keys)
    tiles = tl.arange(0, NT_POW2)
    flags = tl.load(flags_ptr + b * NT + tiles, mask=tiles < NT, other=0, cache_modifier=".cg")
    cut = tl.load(cut_ptr + b * NT + tiles, mask=tiles < NT, other=-2147483648, cache_modifier=".cg")
    if HAS_TOP_P:
        top = tl.max(tl.where(r == 0, v, float("-inf")), axis=0)  # softmax's max
        kth = tl.max(tl.where(r == k - 1, v, float("-inf")), axis=0)
    else:  # the k-th largest word of the lists, searched between the largest cut and the largest
        u = _words((keys >> 32).to(tl.int32))
        hi = tl.max(tl.where(listed, u, 0), axis=0)
        # two bits a count: 17.3 -> 16.5 us a call at batch 1 (H100); the tiles', which stop early
        # and count clustered logits, gained nothing (bench/results/h100/two-bit-micro.log)
        t = _kth_search(u, listed, k, _words(tl.max(cut, axis=0)), hi, -1, k, TWO_BITS=True)[0]
        kth = _from_ordered(_ordered_of(tl.min(tl.where(listed & (u >= t), u, 4294967295), axis=0)))
        top = _from_ordered(_ordered_of(hi))
    # a NaN or +inf score in a tile, or -inf throughout (softmax's 0 / 0): no token
    has_nan = (tl.max(flags & 1, axis=0) > 0) | (top == float("-inf"))
    # a tile left ties unlisted at its cut, and the cut is the k-th value: they are kept too
    overflow = tl.max((((flags & 2) != 0) & (cut == _ordered(kth))).to(tl.int32), axis=0)
    if HAS_TOP_P:  # or the row's sorted list ends inside the tie group: more listed ties than K_TILE
        overflow += tl.max(((r == K_TILE - 1) & listed & (v == kth)).to(tl.int32), axis=0)

    above = listed & (v > kth)
    e = tl.where(listed & (v >= kth), expf(v - top), 0.0)
    ties = tl.full((), 0, tl.int32)  # tied columns at kth outside the lists (overflow only)
    dropped = tl.full((), 0, tl.int32)  # of those, how many top-p drops (the lowest columns)
    e_tie = expf(kth - top)
    if overflow > 0:  # every column > kth is listed; count the ties in the row instead
        e = tl.where(above, e, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            s, _ = _processed(logits_ptr, seen_ptr, cols, cols < V, penalty, temperature, HAS_PENALTY)
            ties += tl.sum(((s == kth) & (cols < V)).to(tl.int32), axis=0)
    total = tl.sum(e, axis=0) + ties.to(tl.float32) * e_tie
    if HAS_TOP_P:  # keep where the ascending running sum passes 1 - top_p; the largest always
        p = tl.div_rn(e, total)
        p_tie = tl.div_rn(e_tie, total)
        running = tl.cumsum(p, axis=0, reverse=True) + ties.to(tl.float32) * p_tie
        e = tl.where((running > drop_mass) | (r == 0), e, 0.0)
        # the j-th unlisted tie's running sum is j * p_tie; the last one stays if nothing is above
        dropped_f = tl.floor(drop_mass / tl.maximum(p_tie, 1e-38))  # finite: a float, then clamped
        dropped = tl.minimum(dropped_f, ties.to(tl.float32)).to(tl.int32)
        dropped = tl.where((top == kth) & (ties > 0), tl.minimum(dropped, ties - 1), dropped)
        total = tl.sum(e, axis=0) + (ties - dropped).to(tl.float32) * e_tie
    drawn = e > 0.0
    q = _noise_at(q_ptr, row_start, col, drawn, noise_threads, NOISE)
    best = tl.max(tl.where(drawn, _argmax_key(tl.div_rn(tl.div_rn(e, total), q), col), empty), axis=0)
    if overflow > 0:  # the unlisted ties past the dropped ones
        p_tie = tl.div_rn(e_tie, total)
        seen_ties = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            s, _ = _processed(logits_ptr, seen_ptr, cols, cols < V, penalty, temperature, HAS_PENALTY)
            tie = (s == kth) & (cols < V)
            rank = seen_ties + tl.cumsum(tie.to(tl.int32), axis=0)
            ok = tie & (rank > dropped)
            qv = _noise_at(q_ptr, row_start, cols, ok, noise_threads, NOISE)
            cand = tl.where(ok, _argmax_key(tl.div_rn(p_tie, qv), cols), _empty_keys(BLOCK_V))
            best = tl.maximum(best, tl.max(cand, axis=0))
            seen_ties += tl.sum(tie.to(tl.int32), axis=0)
    return tl.where(has_nan, V, _key_index(best)).to(tl.int64)


@triton.jit
def _sample_kernel(logits_ptr, seen_ptr, q_ptr, cand_ptr, flags_ptr, cut_ptr, count_ptr, out_ptr,
                   V, NT, k, penalty, temperature, drop_mass,
                   stride_lb, stride_sb, stride_qb, noise_threads,
                   HAS_PENALTY: tl.constexpr, HAS_TOP_P: tl.constexpr, STAGE: tl.constexpr, ARRIVALS: tl.constexpr,
                   BLOCK_C: tl.constexpr, NT_POW2: tl.constexpr, K_TILE: tl.constexpr, BLOCK_V: tl.constexpr,
                   NOISE: tl.constexpr, USE_PDL: tl.constexpr):
    """STAGE (STAGES): the tile lists, and the draw by the row's last tile program to arrive;
    the lists only (grid (NT, B)); the draw only (grid (1, B), after a launch of the lists)."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    if USE_PDL:  # launched while the kernel before runs: everything read here is written by it or earlier
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    logits_ptr += b * stride_lb
    seen_ptr += b * stride_sb
    q_ptr += b * stride_qb  # stride 0 with NOISE: the generator state
    draw = STAGE != 1
    if STAGE != 2:
        _tile_candidates(logits_ptr, seen_ptr, cand_ptr, flags_ptr, cut_ptr, t, b, V, NT, k, penalty, temperature,
                         HAS_PENALTY, BLOCK_V, K_TILE)
        if STAGE == 0:  # all this program's stores of the tile (the flags and cut by one thread) before
            tl.debug_barrier()  # the arrival that releases them, or the draw that reads them back here
        if ARRIVALS:  # merged, over more than one tile
            # acq_rel: this tile's list is visible before the count moves; the last arriver sees all
            draw = tl.atomic_add(count_ptr + b, 1, sem="acq_rel") == NT - 1
    if draw:
        if ARRIVALS:
            tl.atomic_xchg(count_ptr + b, 0, sem="relaxed")  # next launch: after the kernel boundary
        tl.store(out_ptr + b, _draw_row(logits_ptr, seen_ptr, q_ptr, cand_ptr, flags_ptr, cut_ptr, b, V, NT, k,
                                        penalty, temperature, drop_mass, noise_threads, HAS_PENALTY, HAS_TOP_P,
                                        BLOCK_C, NT_POW2, K_TILE, BLOCK_V, NOISE))


def sample_logits(logits, q, top_k, temperature=1.0, top_p=1.0, penalty=1.0, seen=None, out=None):
    """Token ids (B,) int64 drawn from logits (B, V) as transformers samples: the processors,
    softmax, then argmax(p / q) with q (B, V) fp32 ~ Exp(1), or q an ExponentialNoise
    (kernels/noise.py): torch's exponential_ values computed at the drawn columns only. top_k
    from 1 to MAX_TOP_K (the fused path); penalty applies to the columns seen (B, V) bool marks.
    A row whose softmax has NaNs (a NaN logit; scores of +inf, or of -inf throughout) names no
    token: id V, where transformers' draw raises."""
    check_tensor("logits", logits, ndim=2, last_contiguous=True)
    check_device_usable("logits", logits)
    B, V = logits.shape
    dev = logits.device
    in_kernel = isinstance(q, ExponentialNoise)
    if in_kernel:
        check_noise("q", q, dev, (B, V))
    else:
        check_tensor("q", q, ndim=2, dtypes=(torch.float32,), device=dev, last_contiguous=True)
        check_shape("q", q, (B, V))
    if seen is not None:
        check_tensor("seen", seen, ndim=2, dtypes=(torch.bool,), device=dev, last_contiguous=True)
        check_shape("seen", seen, (B, V))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k: expected an integer from 1 to {MAX_TOP_K} (larger ones run in torch), got {top_k!r}")
    for name, x, ok in (("temperature", temperature, temperature > 0), ("top_p", top_p, 0 < top_p <= 1),
                        ("penalty", penalty, penalty > 0)):
        if not ok:
            raise ValueError(f"{name}: expected a number {'in (0, 1]' if name == 'top_p' else '> 0'}, got {x!r}")
    out = torch.empty(B, dtype=torch.int64, device=dev) if out is None else out
    check_tensor("out", out, ndim=1, dtypes=(torch.int64,), device=dev)
    check_shape("out", out, (B,))
    if B == 0:
        return out
    k = min(top_k, V)
    k_tile = max(16, triton.next_power_of_2(k))
    block_v = max(k_tile, min(BLOCK_V_TOP_P if top_p < 1.0 else BLOCK_V, triton.next_power_of_2(V)))
    nt = triton.cdiv(V, block_v)
    cand = torch.empty((B, nt, k_tile), dtype=torch.int64, device=dev)
    flags = torch.empty((B, nt), dtype=torch.int32, device=dev)
    cut = torch.empty((B, nt), dtype=torch.int32, device=dev)
    has_penalty = seen is not None and penalty != 1.0
    seen_arg = seen if has_penalty else flags
    stride_sb = seen.stride(0) if has_penalty else 0
    pdl = use_pdl(dev)
    args = (logits, seen_arg, q.state if in_kernel else q, cand, flags, cut, arrival_counters(dev, B), out, V, nt, k,
            float(penalty), float(temperature), 1.0 - float(top_p), logits.stride(0), stride_sb,
            0 if in_kernel else q.stride(0), q.threads if in_kernel else 0)
    meta = dict(HAS_PENALTY=has_penalty, HAS_TOP_P=top_p < 1.0, BLOCK_C=triton.next_power_of_2(nt * k_tile),
                NT_POW2=triton.next_power_of_2(nt), K_TILE=k_tile, BLOCK_V=block_v, NOISE=in_kernel, USE_PDL=pdl,
                launch_pdl=pdl)
    list_warps = 8 if B <= LIST_WARPS_ROWS else 4
    for stage in ("merged",) if B <= MAX_MERGED_ROWS else ("lists", "draw"):
        launch(_sample_kernel, (nt if stage != "draw" else 1, B), *args, STAGE=STAGES[stage],
               ARRIVALS=stage == "merged" and nt > 1, num_warps=list_warps if stage == "lists" else 16, **meta)
    return out
