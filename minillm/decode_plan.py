"""The decode step's launch plan, by rows and model width: which layer linears let the next
kernel launch at their start (early_roles), what of the next weights each asks L2 for (l2_part,
and the lm_head's share) and how many cache tiles decode attention keeps in flight
(attention_tma_stages). Every rule cites the same-call A/B it came from; the model
(model.GPT.decode) follows it, and its environment switches exist for A/B timing.
"""
import os

ROLES = ("qkv", "attn-out", "fc", "mlp-out")
# model widths from which the decode layouts change (kernels.gemv_config: 256-wide K tiles from
# K = 1024); early_roles' 17-32-row rule was timed below it only
NARROW_WIDTH = 1024
# early roles at 9-16 rows by model width, each GPT-2 size timed apart (early_roles): no layout
# property seen splits the sizes that gained from those that lost; other widths take none
EARLY_ROLES_16_ROWS = {768: frozenset({"mlp-out"}), 1280: frozenset({"mlp-out", "attn-out"}),
                       1600: frozenset({"attn-out"})}


def roles_from_env(value):
    """MINILLM_EARLY_ROLES's value ('fc,qkv' or 'fc+qkv', as scripts/ab_decode.py takes it; 'none';
    None: unset) -> a frozenset of ROLES, or None."""
    if value is None:
        return None
    roles = frozenset(filter(None, value.replace("+", ",").split(","))) - {"none"}
    if not roles <= set(ROLES):
        raise ValueError(f"MINILLM_EARLY_ROLES: expected none or roles of {', '.join(ROLES)} split by commas "
                         f"or +, got {value!r}")
    return roles


def whole_from_env(value, name, unit, default):
    """A whole number of `unit` from the environment variable `name`'s value (None or empty:
    default); one error naming it otherwise."""
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}: expected a whole number of {unit} (0: none), got {value!r}")
    return int(value)


def mb_from_env(value, name="MINILLM_L2_SCREEN_MB", default=4 << 20):
    """A number of MB from the environment variable `name`'s value (None or empty: default) ->
    bytes; one error naming it otherwise."""
    mb = whole_from_env(value, name, "MB", None)
    return default if mb is None else mb << 20


# MINILLM_EARLY_ROLES=fc,qkv (or fc+qkv, or none) sets the early roles at every row count (A/B timing)
EARLY_ROLES_ENV = roles_from_env(os.environ.get("MINILLM_EARLY_ROLES"))


def early_roles(rows, cuda_core, width):
    """The decode linears that let the next kernel launch at their start rather than after
    their wait (linear's early_launch), so its weights stream in behind all of this one, at
    `rows` rows of a model `width` wide (n_embd); cuda_core: one row on the CUDA-core GEMV. Every
    role is safe in the step's order: a kernel launched early reads only constants before its
    wait (weights, the cache's older rows), or a residual whose writer precedes a late trigger
    (mlp-out prefetches it only when fc is late; the fused attention projection,
    kernels.decode_attention_proj, reads the residual and the lengths before its wait only when
    qkv is late, and the model asks it for that). Separate decode attention is always late.
    Where it pays was timed end to end (same-call A/Bs on an H100,
    bench/results/h100/early-roles.md and fused-attention-proj.md):
    - one row on the CUDA-core GEMV (timed at gpt2's size): fc (+2.9%; attn-out too -1.5%) and
      qkv, so the fused launch reads its cache tile and W during qkv (5,468 -> 5,540 tok/s; at 2 rows
      -5%, gpt2-medium -3.7%, gpt2-xl -1.6%); mlp-out too once the CUDA-core kernel's work
      after its wait got short (5,929 -> 5,991; it had lost 3% before);
    - one row on the split tensor-core layouts, attn-out fused: attn-out, fc and mlp-out
      (against fc late: gpt2-large 1,109 -> 1,210 tok/s, gpt2-medium +3%, gpt2-xl +1.2%);
    - up to 4 rows: attn-out, so fc's large weights start during it, and mlp-out: gpt2-xl b1
      +5.4%, gpt2-large b1 +4.3%, gpt2 b2 +4.5%, b4 +6.6% (fc too at b2, fused: -7%);
    - 5 to 8 rows: qkv and mlp-out (gpt2 b8 +2%; attn-out there lost 6-7%);
    - 17 to 32 rows (the batch bucket of 32) of gpt2's width (below 1024): qkv, so decode
      attention's first cache tiles come in during it (H200, sixty-eighth session,
      bench/results/h200/b64-rules/: gpt2 b32 +2.7% to +3.0%, b24 +2.4%; fc +2.2%, fc and
      mlp-out +2.7%, qkv with fc or mlp-out +1.5% / +1.3%, attn-out -3.8%). Wider layers
      (their own layouts) did not gain: gpt2-medium even, gpt2-large and gpt2-xl b32 -1.1%;
    - 9 to 16 rows (the bucket of 16; split layouts), by width (H200, sixty-ninth session,
      bench/results/h200/leads-69/, each against the role set before it, alternated twice):
      gpt2 mlp-out (+1.8%; with attn-out -6.6%; qkv -4.3%, fc -1.5%, pairs -2.9% to +0.6% in
      the sixty-eighth session); gpt2-large mlp-out (+3.8%) and attn-out (+4.3% more; with fc
      -5.0%, with qkv -3.7% in one round); gpt2-xl attn-out (+1.6%; mlp-out -0.5%, both -1.3%);
      gpt2-medium none (mlp-out -0.1%, attn-out -5.1%, both -5.8%);
    - other rows (looping layouts): none (every kernel early lost 9% at b64 on the H100; on the
      H200 at b64 each role alone moved -1.0% to +0.6%, and with the whole-slab layouts -0.6% to
      -1.8%: bench/results/h200/session-84/call6-ab.log).
    Re-timed at one row on the H200 (sixty-seventh session, MINILLM_EARLY_ROLES, alternated
    twice, the same ids; bench/results/h200/fused-attn-ab/call4-*): gpt2 without qkv -1.0%, with
    attn-out too -8.7%; gpt2-xl without attn-out -0.8%, with qkv too -2.9%, qkv in its place -3.3%.
    gpt2-xl's one row on the CUDA-core GEMV (ninety-fourth session, one round,
    bench/results/h200/session-94/): without qkv -1.5%, without fc -2.0%, without mlp-out -2.8%,
    attn-out too -0.1%; with the attention launch in 8 warps attn-out too -0.6% (alternated twice,
    session-115/call3-ab-xl.log)."""
    if EARLY_ROLES_ENV is not None:
        return EARLY_ROLES_ENV
    if cuda_core:
        return frozenset({"fc", "qkv", "mlp-out"})
    if rows == 1:
        return frozenset({"attn-out", "fc", "mlp-out"})
    if rows <= 4:
        return frozenset({"attn-out", "mlp-out"})
    if rows <= 8:
        return frozenset({"qkv", "mlp-out"})
    if rows <= 16:
        return EARLY_ROLES_16_ROWS.get(width, frozenset())
    if rows <= 32 and width < NARROW_WIDTH:
        return frozenset({"qkv"})
    return frozenset()


# decode attention's stages of cache tiles in flight where it reads them by tensor descriptors
# (kernels.decode_attention_config.tma_tiles: from 22 rows over short caches), by model width at
# 33-64 rows (the batch bucket of 64); other widths and rows: the kernel's 3
ATTN_TMA_STAGES_64_ROWS = {768: 2, 1024: 4}


def attention_tma_stages(rows, width):
    """Stages decode attention keeps in flight over its descriptor tiles at `rows` rows of a model
    `width` wide (kernels.decode_attention's tma_stages), or None for the kernel's 3. H200, 4 against
    3, alternated twice in fresh processes, the same ids (bench/results/h200/session-120/, calls 3
    and 4): gpt2-medium's bucket of 64 gains (batch 40 +1.3%, 48 +1.3%, 64 +1.2%: 62,332 / 62,393
    -> 63,094 / 63,073 tok/s); its bucket of 32 is even (batch 24 -0.4%, 32 +0.3%); the other sizes'
    bucket of 64 lose (gpt2 -2.8%, gpt2-large -1.2%, gpt2-xl -1.2%; xl's 32 even). 2 stages lost
    gpt2-medium 2.2% at 48 and 64 (call 2). The launch's own inputs do not tell medium's 1,024
    (row, head) pairs apart: 768, 800, 1,280 and 1,600 lose or are even; what differs is the
    linears that run beside it, so the rule is the model's. As the default against
    MINILLM_ATTN_STAGES=3 on another machine: gpt2-medium batch 64 +1.1% (call 6). Under the
    "positions" cache layout gpt2's bucket of 64 gains in 2 (session-125/, calls 4-5, one host: batch
    64 +1.3% over two rounds and +0.5% over three, batch 48 +0.5%, the same ids; 4 stages -3.4%);
    as the default against MINILLM_ATTN_STAGES=3 on another machine, four rounds (session-126/,
    call 1): batch 64 +0.7%, 48 +0.6%, ahead in three rounds of four, the same ids. The wider
    models keep 3 (call 3, 2 stages against 3 at batch 64: gpt2-large even, gpt2-xl -1.6%).
    MINILLM_ATTN_STAGES=n sets every launch's stages (A/B timing)."""
    if 32 < rows <= 64:
        return ATTN_TMA_STAGES_64_ROWS.get(width)
    return None


def positions_from_env(value, name="MINILLM_CACHE_PAD"):
    """A count of cache positions from the environment variable `name`'s value (None or empty:
    0); one error naming it otherwise."""
    return whole_from_env(value, name, "cache positions", 0)


# The KV cache's layout in memory (KVCache's layout and pad). A decode step reads the first
# ~100 of each (row, head)'s 1,024 positions: in the "heads" layout 768 runs of ~13 KB, 128 KB
# apart, at gpt2 batch 64; "positions" stores each position's rows and heads together, so a short
# context's positions are one dense block (about 10 MB a layer). H200, session 122 (calls 1-3),
# positions against heads alternated in fresh processes: gpt2 batch 64 +1.1% (every one of 3
# rounds; +1.1-1.2% within each engine of a side-by-side probe), a 768-token prompt at 64 rows
# +1.0%, 128 rows +0.4%, 32 +0.2%, gpt2-medium and gpt2-xl at 64 rows +0.5%, one row even
# (-0.3..+0.1%); the same bits. The pad (unused positions after each run, so runs do not start a
# power of two apart) read +0.6% with heads and nothing with positions: none by default.
# MINILLM_CACHE_LAYOUT=heads|positions and MINILLM_CACHE_PAD=n set them for every cache (A/B
# timing; scripts/probe_cache_placement.py alternates them within one process)
CACHE_LAYOUTS = ("heads", "positions")  # (model.KVCache's layouts)
CACHE_PAD = positions_from_env(os.environ.get("MINILLM_CACHE_PAD"))
CACHE_LAYOUT = os.environ.get("MINILLM_CACHE_LAYOUT") or "positions"
if CACHE_LAYOUT not in CACHE_LAYOUTS:
    raise ValueError(f"MINILLM_CACHE_LAYOUT: expected {' or '.join(CACHE_LAYOUTS)}, got {CACHE_LAYOUT!r}")


# L2 requests ahead, at one row on the CUDA-core GEMV (model.GPT.decode's l2_ahead): the fused
# attention launch asks L2 for fc's and mlp-out's weights before its wait, mlp-out for the next
# layer's qkv weights, and qkv (from layer 1; layer 0's gathers the embedding) for its layer's
# W_o, which the attention launch reads before its wait. H200, alternated in one call, the same
# ids: gpt2 batch 1 7,540 / 7,545 -> 7,807 / 7,800 tok/s with the first (+3.5%;
# bench/results/h200/session-71/); mlp-out's 7,813 / 7,802 -> 7,900 / 7,902 (+1.2%; fc asking for
# them instead -0.8%, both even; session-72/); qkv's +0.5% (8,423 / 8,416 / 8,444 / 8,439 ->
# 8,451 / 8,497 / 8,471 / 8,484), +0.3% in the call before; mlp-out asking for W_o beside the next
# qkv's -0.7%. Before the tensor-core layouts the first lost in the forms timed (gpt2 batch 2
# -4.2%, gpt2-medium batch 1 -7.9%, gpt2-xl batch 1 -2.7% to -12%), and so did fc asking for
# mlp-out's weights at gpt2-xl (-5.3%; session-92/).

# the lm_head's share that the last layer's mlp-out asks L2 for (its first columns, which its
# first programs read): 4 MB +1.2% at gpt2 batch 1, 16 MB -0.3%, none +0.9% (one call)
L2_LM_HEAD_BYTES = 4 << 20
# the same for the screened head's int8 copy: its first 4 MB, +0.4% against the fp16 head's
# (bench/results/h200/session-79/). Against none, H200, gpt2 batch 1, alternated twice, the same ids
# (bench/results/h200/session-80/): none +0.4% in one call, -1.3% in the next; 8 MB -0.1%, 12 MB -0.6%.
# MINILLM_L2_SCREEN_MB=n asks for n MB (A/B timing)
L2_SCREEN_BYTES = mb_from_env(os.environ.get("MINILLM_L2_SCREEN_MB"))
GPT2_WIDTH = 768  # n_embd up to which each layer weight is asked for whole (timed at gpt2's)
# past gpt2's width each layer weight the CUDA-core GEMV's chain asks L2 for (decode's l2_ahead) is
# asked for only up to its first 2 MB. gpt2-xl batch 1, H200 (bench/results/h200/session-93/):
# 4 MB 835 tok/s, 832 with no requests, 801 with 8 MB, 697 whole (fc's and mlp-out's 41 MB at
# once). 2 MB against 4, alternated twice, the same ids (session-94/): gpt2-xl 835 / 834 -> 838 /
# 837 (+0.4%), gpt2-medium 3,115 / 3,099 -> 3,141 / 3,133 (+1.0%). The last columns instead (read
# by the GEMV's last programs, which start as the first ones leave) lost: gpt2-xl 2 MB -2.4%, 4 MB
# -2.5%, 8 MB -5.3% (session-99/)
# MINILLM_L2_AHEAD_MB=n caps them at n MB at every width (A/B timing)
L2_WIDE_CAP = 2 << 20
L2_CAP_ENV = mb_from_env(os.environ.get("MINILLM_L2_AHEAD_MB"), "MINILLM_L2_AHEAD_MB", None)


def first_columns(w, nbytes):
    """An out-major (K, N) weight's first columns within nbytes: a dense view of its first bytes
    (none for fewer than a column's)."""
    return w[:, :nbytes // (w.shape[0] * w.element_size())]


def l2_part(w, width):
    """What of an out-major (K, N) layer weight a model `width` wide asks L2 for: all of it, or
    its first columns up to the cap."""
    cap = L2_CAP_ENV if L2_CAP_ENV is not None else L2_WIDE_CAP if width > GPT2_WIDTH else None
    return w if cap is None else first_columns(w, cap)  # (0 MB: no columns, no request)
