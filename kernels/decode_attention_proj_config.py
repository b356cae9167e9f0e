"""Where the fused attention launch (decode_attention_proj.py) runs, in which layout and how its
heads meet: the rules timed end to end, as tables and thresholds, and the switches that force
them (A/B timing)."""
import os

import torch
import triton

from ._epilogue import new_row_stats
from ._fixed_merge import MAX_FIXED_PARTS
from ._tuning import env_choice, layout_switch, mask_switch, sm_count

MAX_ROWS = 2  # gpt2 at 4 rows: 16.4k -> 15.1k tok/s at best (H100)
MAX_HEADS_AT_TWO_ROWS = 16  # fused_layout: gpt2-large's and gpt2-xl's two rows run the two kernels
MAX_CACHE = 256  # positions of the longest prefetched tile; longer caches split across programs
# MINILLM_FUSED_ATTN=0 runs decode_attention and linear wherever the fused launch would (A/B timing)
FUSED = os.environ.get("MINILLM_FUSED_ATTN", "1") != "0"
# the one-atomic merge where no statistics are asked for; MINILLM_FIXED_MERGE=0 turns it off (A/B timing)
FIXED_MERGE = os.environ.get("MINILLM_FIXED_MERGE", "1") != "0"
# the one-atomic merge with the statistics in fixed point (fixed_row_stats); MINILLM_FIXED_STATS=0
# keeps the stored-partial merge wherever statistics are asked for, =all takes the fixed form
# wherever it fits, past fixed_stats_rule (A/B timing)
FIXED_STATS = env_choice("MINILLM_FIXED_STATS", "1", ("0", "1", "all"))
MAX_FIXED_STATS_COLS = 1 << 14  # a row's sum of squares stays below 2**62 (_epilogue's units)
# which prefetched tiles are converted to fp32 before the wait (early_f32), by width at two rows:
# 1 the keys, 2 the values, 4 W's. H200, alternated twice in one call, the same ids
# (bench/results/h200/session-75/): gpt2 batch 2 9,240 / 9,254 -> 9,372 / 9,365 tok/s (+1.3%) with
# the keys and values (+1.5% in a second call); with W's too -2.6%. Elsewhere they lost: gpt2-medium
# batch 2 -1.0%, batch 1 gpt2 -1.2% (with W's -19.1%; keys or values alone -1.6% each, session-78/),
# gpt2-xl -1.4%, gpt2-medium and gpt2-large even
EARLY_F32_AT_TWO_ROWS = {768: 3}
# one row of these widths (n_embd) on wider column blocks where the whole tile has 256 positions
# (fused_layout). H200, alternated twice in one call, the same ids (bench/results/h200/session-74/):
# gpt2-large batch 1 1,272 / 1,271 -> 1,424 / 1,427 tok/s (+12.1%; +11.4% in another call) with
# 512 columns (60 programs) over the whole tile in 8 warps, where 256 columns over it lost 0.6%;
# the same 512 columns lost at gpt2-medium (-7.2%) and gpt2-xl (-0.6%; 128 positions up front -4.8%)
WIDE_BLOCK_N = {1280: 512}
# one row of these widths in 8 warps where the programs outnumber 3/4 of the SMs (fused_layout's
# last case: up to 128 positions up front). H200, alternated twice in one call, the same ids, at
# the benchmark's 256-position cache (bench/results/h200/session-114/call2-ab-xl.log, call3-):
# gpt2-xl 847 / 847 -> 855 / 855 tok/s (+0.9%), on another host 850 / 850 -> 857 / 857 (+0.8%);
# session 94 had +0.3% in one round. Shorter caches' tiles were not timed. Against it, alternated
# twice (session-115/call3-, call4-): 512 columns in 8 warps -1.1%, 16 warps -12.0% (256 columns:
# an SM holds one program, 175 run in two waves) and -6.1% (512)
WIDE_WARPS_AT_ONE_ROW = {1600: 8}


def forced_layout(text):
    """MINILLM_FUSED_LAYOUT's (BLOCK_N, BLOCK_L, num_warps), e.g. "512x256x8", or None where unset:
    the layout of every fused launch (A/B timing). One ValueError for anything else."""
    return layout_switch("MINILLM_FUSED_LAYOUT", text, "BLOCK_NxBLOCK_LxWARPS", "512x256x8")


FORCED_LAYOUT = forced_layout(os.environ.get("MINILLM_FUSED_LAYOUT"))


def forced_early_f32(text):
    """MINILLM_ATTN_EARLY_F32's mask (0-7: 1 keys, 2 values, 4 W), or None where unset: the
    early conversions of every fused launch (A/B timing). One ValueError for anything else."""
    return mask_switch("MINILLM_ATTN_EARLY_F32", text, "1 keys + 2 values + 4 W")


FORCED_EARLY_F32 = forced_early_f32(os.environ.get("MINILLM_ATTN_EARLY_F32"))


def early_f32(rows, n):
    """Which prefetched tiles the fused launch converts to fp32 before its wait (a mask: 1 keys,
    2 values, 4 W). ptxas otherwise puts every conversion after the wait, among the products,
    on the path from q's arrival to the output; the wait, predicated on the converted tiles'
    maximum (_gdc_wait_after), keeps them before it. That holds more registers, and the
    maximum's reduction runs beside the kernel before: it gained at gpt2's two rows only
    (EARLY_F32_AT_TWO_ROWS)."""
    if FORCED_EARLY_F32 is not None:
        return FORCED_EARLY_F32
    return EARLY_F32_AT_TWO_ROWS.get(n, 0) if rows == 2 else 0


def fused_layout(rows, n, cache_len, head_dim, heads, *, sms):
    """(BLOCK_N, BLOCK_L, num_warps) of the fused kernel, or None where the two kernels run.
    The first BLOCK_L cache positions are read before the wait, the rest in a loop after it.
    Timed end to end on an H100 against the two kernels (bench/results/h100/fused-attention-proj.md):
    - 256-column blocks: each recomputes its head's attention, and 128 columns lost everywhere
      (gpt2-xl 650 -> 550 tok/s); 512 was no better than 256;
    - a whole-cache tile in 8 warps while the programs (rows x heads x column blocks) fill up to
      3/4 of the SMs (gpt2 b1 36: 5,330 -> 5,530, b2 72: +1.8%, gpt2-medium 64: 1,847 ->
      2,004); past that 128 positions up front in 4 warps (gpt2-large 100: 1,081 -> 1,108,
      gpt2-xl 175: 650 -> 666), where the 8-warp tile was even or slower (gpt2-xl 608);
    - 4 warps for a whole tile of up to 128 x 64 elements, except at 128 x 64 (128 positions of
      64-wide heads) with up to 3 column blocks a head (gpt2's width): 8 warps there, H200,
      alternated in one call at a 128-position cache
      (bench/results/h200/warps-at-128-ab-dd47f84.log): gpt2 b1 7,156 -> 7,605 tok/s (+6.3%),
      sampled +4.2%, b2 +1.6%; gpt2-medium's 4 blocks lost with 8 (2,178 -> 2,130);
    - two rows of more than MAX_HEADS_AT_TWO_ROWS heads run the two kernels: H200, alternated
      twice in one call (bench/results/h200/fused-attn-ab/), gpt2-large batch 2 (200 programs)
      2,137 / 2,132 -> 2,206 / 2,200 tok/s (+3.2%), gpt2-xl batch 2 (350) 1,232 / 1,233 ->
      1,298 / 1,299 (+5.4%). Everywhere else the fused launch stays ahead of them: gpt2 batch 1
      +11%, batch 2 +6.5%, gpt2-medium +14.7% and +5.5%, gpt2-xl batch 1 +3.2%, gpt2-large
      batch 1 +0.6% (even). Why is not profiled;
    - one row of a width in WIDE_BLOCK_N (gpt2-large's) over a 256-position tile: wider column
      blocks (H200; a table of the timed widths, as no layout property seen separates them).
    Re-timed at gpt2-xl's one row with its layers on CUDA cores (H200, ninety-fourth session, one
    round, bench/results/h200/session-94/call3-*), against 256 x 128 x 4: 512 x 128 x 4 -1.1%,
    256 x 256 x 8 -5.4%, 512 x 256 x 8 -0.9%, 256 x 128 x 8 +0.3% (inside the spread); the two
    kernels -2.5%. Alternated twice in the hundred-and-fourteenth, 256 x 128 x 8 gained 0.9%
    (WIDE_WARPS_AT_ONE_ROW, beside it the layouts that lost against it since)."""
    if (not FUSED or rows > MAX_ROWS or (rows == 2 and heads > MAX_HEADS_AT_TWO_ROWS) or cache_len > MAX_CACHE
            or head_dim > 128):
        return None
    if FORCED_LAYOUT is not None:
        return FORCED_LAYOUT
    whole = max(16, triton.next_power_of_2(cache_len))
    block_n = WIDE_BLOCK_N.get(n, 256) if rows == 1 and whole == MAX_CACHE else 256
    blocks = triton.cdiv(n, block_n)
    if 4 * rows * heads * blocks <= 3 * sms:
        elements = whole * head_dim
        return block_n, whole, 8 if elements > 128 * 64 or (elements == 128 * 64 and blocks <= 3) else 4
    return block_n, min(whole, 128), WIDE_WARPS_AT_ONE_ROW.get(n, 4) if rows == 1 else 4


def fixed_merge(heads):
    """Whether the fused launch's heads meet by the one-atomic merge (_fixed_merge.py)."""
    return FIXED_MERGE and 1 < heads <= MAX_FIXED_PARTS


def fixed_stats_rule(heads):
    """Whether the statistics come in fixed point (where the fused launch runs): up to 16 heads.
    Two rows from 24 heads took them too until the two kernels replaced the fused launch there
    (fused_layout). H200, alternated twice in one call (bench/results/h200/fixed-stats/;
    the same ids except at gpt2-large's and gpt2-xl's two rows): gpt2 batch 2 8,893 / 8,907 -> 9,251 / 9,249 tok/s
    (+3.9%), gpt2-medium batch 1 +2.5%, batch 2 +2.3%, gpt2-xl batch 2 +5.0%; but gpt2-large
    (20 heads) batch 1 -0.7%, batch 2 -1.2%, and gpt2-xl batch 1 -1.3%. There the graph profile
    has the launch's share 6.54 -> 5.62 us a layer, but the next layer's qkv 5.91 -> 7.41; traced
    per program the launch itself is longer (its wait to its last end 5.01 -> 5.55 us: 25 returning
    atomics a column; bench/results/h200/session-70/). The H100 gained at every case kept (+1.3%
    to +4.9%). Past the rule (MINILLM_FIXED_STATS=all) with the gemv merge at one row
    (gemv_config.fixed_split), H200, one call, the rule's form timed twice and the forced form
    once (bench/results/h200/fixed-stats-all/):
    gpt2-xl batch 1 756 -> 712 tok/s (-5.8%), gpt2-large batch 1 1,278 -> 1,262 (-1.3%), the same ids."""
    return heads <= 16


def fixed_stats_fit(heads, n, dtype, layout):
    """Whether a launch can write the fixed-point statistics: the fused one (`layout` not None)
    with the fixed merge, in half precision, rows of up to MAX_FIXED_STATS_COLS columns."""
    return layout is not None and fixed_merge(heads) and dtype == torch.float16 and n <= MAX_FIXED_STATS_COLS


def fixed_row_stats(layers, rows, n, cache_len, head_dim, heads, dtype, device):
    """Zeroed fixed-point statistics buffers (layers, rows, 2, groups) for decode_attention_proj's
    stats_out (one a layer: each is added into once, then read), or None where its launch for
    these shapes cannot write them (fixed_stats_fit) or fixed_stats_rule says no."""
    layout = fused_layout(rows, n, cache_len, head_dim, heads, sms=sm_count(device))
    ruled = FIXED_STATS == "all" or (FIXED_STATS == "1" and fixed_stats_rule(heads))
    if not (ruled and fixed_stats_fit(heads, n, dtype, layout)):
        return None
    return new_row_stats(layers * rows, n, device, fixed=True).view(layers, rows, 2, -1)
