"""GPT-2 forward passes over a static KV cache, every op through a kernel backend.

The backend is a module with the `kernels` API: `kernels` itself (Triton) or
`kernels.reference` (plain torch). This file never imports triton.
"""
import os

import torch

import kernels
import kernels.reference
from kernels.reference import fold_layernorm

BACKENDS = {"triton": kernels, "torch": kernels.reference}


class KVCache:
    """Preallocated keys and values for every layer: (n_layer, B, H, L, D) each. The kernels
    write it: prefill attention (k_out, v_out) and each decode step's attention (k_new, v_new)."""

    def __init__(self, n_layer, batch, n_head, max_len, head_dim, dtype, device):
        shape = (n_layer, batch, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def batch(self):
        return self.k.shape[1]

    @property
    def max_len(self):
        return self.k.shape[3]

    @property
    def nbytes(self):
        return 2 * self.k.numel() * self.k.element_size()

    def layer(self, layer, batch, length=None):
        """(k, v) views (batch, H, length, D) of one layer: the first `batch` rows and positions."""
        return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, :length]


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
    attn-out too -0.1%."""
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


def out_major(w):
    """A Conv1D weight (in, out) as a view of out-major storage (nn.Linear's): each output's
    weights contiguous, which the one-row CUDA-core GEMV streams in whole rows
    (kernels/gemv_fma.py); the tensor-core kernels read either layout through strides. One copy
    at load; the stored original goes when the caller drops the weights dict."""
    return w.t().contiguous().t()


def folded(weight, bias, ln_weight, ln_bias):
    """(weight, bias, column sums) of a linear with the layernorm before it folded in, the
    weight out-major: linear(x, w, b, ln_fold=colsum) is then linear(layernorm(x), ...)."""
    w, b, colsum = fold_layernorm(weight, bias, ln_weight, ln_bias)
    return out_major(w), b, colsum


# the lm_head's share that the last layer's mlp-out asks L2 for (its first columns, which its
# first programs read): 4 MB +1.2% at gpt2 batch 1, 16 MB -0.3%, none +0.9% (one call)
L2_LM_HEAD_BYTES = 4 << 20
# the same for the screened head's int8 copy: its first 4 MB, +0.4% against the fp16 head's
# (bench/results/h200/session-79/). Against none, H200, gpt2 batch 1, alternated twice, the same ids
# (bench/results/h200/session-80/): none +0.4% in one call, -1.3% in the next; 8 MB -0.1%, 12 MB -0.6%.
# MINILLM_L2_SCREEN_MB=n asks for n MB (A/B timing)
def mb_from_env(value, name="MINILLM_L2_SCREEN_MB", default=4 << 20):
    """A number of MB from the environment variable `name`'s value (None or empty: default) ->
    bytes; one error naming it otherwise."""
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}: expected a whole number of MB (0: none), got {value!r}")
    return int(value) << 20


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


# greedy decoding's lm_head past one row writes its argmax keys alone, no logits (linear's
# keys_only); MINILLM_HEAD_LOGITS=1 stores them anyway (A/B timing)
HEAD_KEYS_ONLY = os.environ.get("MINILLM_HEAD_LOGITS", "0") != "1"


class Block:
    """One transformer layer's weights; Conv1D weights (in, out), stored out-major. ln_1 and
    ln_2 live folded into the linears after them (qkv and fc)."""

    def __init__(self, w, i):
        p = f"h.{i}."
        ln_1, ln_2 = (w[p + "ln_1.weight"], w[p + "ln_1.bias"]), (w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        self.attn = folded(w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"], *ln_1)    # (C, 3C)
        self.attn_proj = (out_major(w[p + "attn.c_proj.weight"]), w[p + "attn.c_proj.bias"])  # (C, C)
        self.fc = folded(w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"], *ln_2)             # (C, 4C)
        self.mlp_proj = (out_major(w[p + "mlp.c_proj.weight"]), w[p + "mlp.c_proj.bias"])    # (4C, C)


class GPT:
    def __init__(self, config, weights, backend="triton"):
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {backend!r}")
        self.config = config
        self.backend = backend
        self.ops = BACKENDS[backend]
        self.wte, self.wpe = weights["wte.weight"], weights["wpe.weight"]
        # ln_f folded into the lm_head (C, V); a tied head (wte) becomes a copy of its own
        head = weights.get("lm_head.weight", self.wte)
        self.lm_head = folded(head.t(), None, weights["ln_f.weight"], weights["ln_f.bias"])
        # greedy decoding's argmax at one row from an int8 copy of the head (None: the full head)
        self.lm_screen = self.ops.screen_head(*self.lm_head)
        self.blocks = [Block(weights, i) for i in range(config.n_layer)]

    @property
    def device(self):
        return self.wte.device

    @property
    def dtype(self):
        return self.wte.dtype

    def new_cache(self, batch, max_len=None):
        c = self.config
        return KVCache(c.n_layer, batch, c.n_head, max_len or c.n_positions, c.head_dim, self.dtype, self.device)

    # Every kernel that writes the residual stream x also leaves its rows' partial statistics
    # (stats_out); the next layernorm-folded linear reads those (ln_stats) instead of whole rows.
    def _ln_linear(self, x, weights, stats, **kw):
        w, b, colsum = weights
        return self.ops.linear(x, w, b, ln_fold=colsum, ln_eps=self.config.layer_norm_epsilon, ln_stats=stats, **kw)

    # early: the roles (early_roles) that let the next kernel launch at their start
    def _attention_in(self, blk, x, stats, early=frozenset(), l2_ahead=()):  # qkv = ln_1(x) @ W + b
        return self._ln_linear(x, blk.attn, stats, early_launch="qkv" in early, l2_ahead=l2_ahead)

    def _attention_out(self, blk, y, x, stats_out):  # prefill: x += proj(y)
        # x was last written before qkv, and attention (no dependent launch) lies between
        return self.ops.linear(y, *blk.attn_proj, residual=x, out=x, stats_out=stats_out, prefetch_residual=True)

    def _mlp(self, blk, x, stats, stats_out, early=frozenset(), l2_ahead=()):
        # fc early lets mlp-out launch at fc's start, maybe before attn-out (which writes x) is
        # done, so mlp-out then reads its residual after its wait
        fc_early = "fc" in early
        f = self._ln_linear(x, blk.fc, stats, activation=self.config.activation, early_launch=fc_early)
        return self.ops.linear(f, *blk.mlp_proj, residual=x, out=x, stats_out=stats_out,
                               prefetch_residual=not fc_early,
                               early_launch="mlp-out" in early, l2_ahead=l2_ahead)  # x += mlp(ln_2(x))

    def _logits(self, x, stats=None, argmax_keys=None):
        if self._screened(x.shape[0], argmax_keys):
            # the argmax key alone, from about half the head's bytes (kernels.vocab_screen)
            self.ops.screened_argmax(x, *self.lm_head, self.config.layer_norm_epsilon, self.lm_screen, argmax_keys)
            return None
        keys_only = HEAD_KEYS_ONLY and argmax_keys is not None
        return self._ln_linear(x, self.lm_head, stats, argmax_keys=argmax_keys, keys_only=keys_only)

    def prefill(self, ids, seq_lens, cache, all_logits=False):
        """Run right-padded prompts ids (B, T) with lengths seq_lens (B,) through the model,
        filling cache positions 0..T. Returns logits (B, V) at each prompt's last token, or
        (B, T, V) at every position with all_logits."""
        c, ops = self.config, self.ops
        B, T = ids.shape
        H, D, C = c.n_head, c.head_dim, c.n_embd
        pos = torch.arange(T, device=ids.device, dtype=torch.int32).repeat(B)
        st_a, st_b = ops.new_row_stats(B * T, C, ids.device), ops.new_row_stats(B * T, C, ids.device)
        x = ops.embedding(ids.reshape(-1), pos, self.wte, self.wpe, stats_out=st_a)  # (B*T, C)
        y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
        for i, blk in enumerate(self.blocks):
            qkv = self._attention_in(blk, x, st_a).view(B, T, 3, H, D)
            q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # (B, H, T, D) views
            k_cache, v_cache = cache.layer(i, B, T)  # attention copies k, v into positions 0..T
            ops.attention(q, k, v, causal=True, seq_lens=seq_lens, out=y.transpose(1, 2),
                          k_out=k_cache, v_out=v_cache)
            x = self._attention_out(blk, y.view(B * T, C), x, st_b)
            x = self._mlp(blk, x, st_b, st_a)
        if all_logits:
            return self._logits(x, st_a).view(B, T, -1)
        last = x.view(B, T, C)[torch.arange(B, device=x.device), seq_lens.long() - 1]  # (B, C)
        return self._logits(last)

    def decode(self, tokens, pos, cache, max_len=None, argmax_keys=None):
        """One new token per sequence: tokens (B,) at positions pos (B,), int32. Appends each
        token's key/value at pos[b] and returns logits (B, V), or None with argmax_keys: the
        keys alone (HEAD_KEYS_ONLY; at one row the backend may screen the head). max_len (> every
        pos) narrows the cache the attention kernel splits over, so short contexts launch fewer
        idle programs.
        argmax_keys (B,) int64, holding kernels.argmax_key.EMPTY: each row's argmax is max-ed in as a
        key, fused into the lm_head (greedy; append_tokens(from_keys=True) reads and resets it)."""
        c, ops = self.config, self.ops
        B = tokens.shape[0]
        H, D, C = c.n_head, c.head_dim, c.n_embd
        seq_lens = torch.empty_like(pos)  # pos + 1, written with the embedding
        # None at one row where the layers run on the CUDA-core GEMV (gemv_fma.fma_config: gpt2,
        # gpt2-medium, gpt2-xl), which reads whole rows and writes no statistics
        st_a, st_b = ops.decode_row_stats(B, C, tokens.device), ops.decode_row_stats(B, C, tokens.device)
        cuda_core = st_a is None  # the layer linears on the CUDA-core GEMV
        early = early_roles(B, cuda_core=cuda_core, width=C)
        # there the fused attention launch asks L2 for fc's and mlp-out's weights before its wait,
        # and mlp-out for the next layer's qkv weights (l2_ahead). H200, alternated in one call:
        # gpt2 batch 1 7,540 / 7,545 -> 7,807 / 7,800 tok/s with the first (+3.5%;
        # bench/results/h200/session-71/); mlp-out's 7,813 / 7,802 -> 7,900 / 7,902 (+1.2%; fc
        # asking for them instead -0.8%, both even; bench/results/h200/session-72/), the same ids.
        # Before the tensor-core layouts the first lost in the forms timed (gpt2 batch 2 -4.2%,
        # gpt2-medium batch 1 -7.9%, gpt2-xl batch 1 -2.7% to -12%), and so did fc asking for
        # mlp-out's weights at gpt2-xl (-5.3%; bench/results/h200/session-92/). And qkv (from layer
        # 1; layer 0's gathers the embedding) asks for its layer's W_o, which the attention launch
        # reads before its wait: +0.5% (8,423 / 8,416 / 8,444 / 8,439 -> 8,451 / 8,497 / 8,471 /
        # 8,484 tok/s), +0.3% in the call before; mlp-out asking for it beside the next qkv's -0.7%.
        # Where the attention launch merges its heads in fixed point, its statistics for fc come
        # in fixed point too: a zeroed buffer a layer, added into (None: st_b as it is)
        st_fixed = None if st_b is None else ops.fixed_row_stats(
            c.n_layer, B, C, cache.layer(0, B, max_len)[0].shape[2], D, H, self.dtype, tokens.device)
        # x (B, C) and layer 0's qkv; one launch where qkv is the CUDA-core GEMV (its programs gather x)
        w, b, colsum = self.blocks[0].attn
        x, qkv = ops.embedding_linear(tokens, pos, self.wte, self.wpe, w, b, ln_fold=colsum,
                                      ln_eps=c.layer_norm_epsilon, stats=st_a, lens_out=seq_lens,
                                      early_launch="qkv" in early)
        screened = self._screened(B, argmax_keys)
        for i, blk in enumerate(self.blocks):
            if i:
                w_o = (l2_part(blk.attn_proj[0], C),) if cuda_core else ()
                qkv = self._attention_in(blk, x, st_a, early, l2_ahead=w_o)
            qkv = qkv.view(B, 3, H, D)
            k_cache, v_cache = cache.layer(i, B, max_len)
            st_attn = st_b if st_fixed is None else st_fixed[i]
            # x += attention(q) @ W + b, one launch at few rows and a short cache. It reads the
            # cache's older rows before its wait, up to pos (final before the step: only
            # append_tokens, after the lm_head, advances it); x (written by mlp-out, before qkv)
            # and the lengths too where qkv triggers late, and so launches it only after its own wait
            qkv_early = "qkv" in early
            x = ops.decode_attention_proj(qkv[:, 0], k_cache, v_cache, seq_lens, qkv[:, 1], qkv[:, 2],
                                          *blk.attn_proj, residual=x, out=x, stats_out=st_attn,
                                          prefetch="cache" if qkv_early else True,
                                          positions=pos if qkv_early else None,
                                          early_launch="attn-out" in early,
                                          l2_ahead=(l2_part(blk.fc[0], C), l2_part(blk.mlp_proj[0], C))
                                          if cuda_core else ())
            x = self._mlp(blk, x, st_attn, st_a, early,
                          l2_ahead=self._next_weight(i, screened) if cuda_core else ())
        return self._logits(x, st_a, argmax_keys)

    def _next_weight(self, i, screened):
        """What layer i's mlp-out asks L2 for (one row on the CUDA-core GEMV), as l2_ahead: the next
        layer's qkv weights, or after the last layer the lm_head's first columns: of its int8
        copy where the screened head runs (L2_SCREEN_BYTES; none for 0)."""
        if i + 1 < len(self.blocks):
            return (l2_part(self.blocks[i + 1].attn[0], self.config.n_embd),)
        if screened:
            q = self.lm_screen.q  # (V, C // 4) int32 words: a column's bytes contiguous
            rows = L2_SCREEN_BYTES // (q.shape[1] * 4)
            return (q[:rows],) if rows else ()
        return (first_columns(self.lm_head[0], L2_LM_HEAD_BYTES),)  # (C, V), out-major

    def _screened(self, B, argmax_keys):
        """Whether this step's lm_head is the screened head (kernels.vocab_screen)."""
        return argmax_keys is not None and B == 1 and self.lm_screen is not None
