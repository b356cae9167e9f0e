"""GPT-2 forward passes over a static KV cache, every op through a kernel backend.

The backend is a module with the `kernels` API: `kernels` itself (Triton) or
`kernels.reference` (plain torch). This file never imports triton.
"""
import math
import os

import torch

from . import own_kernels  # noqa: F401  (first: checks that `kernels` is minillm's)
import kernels
import kernels.reference
from kernels.reference import fold_layernorm

from . import decode_plan as plan

BACKENDS = {"triton": kernels, "torch": kernels.reference}


class KVCache:
    """Preallocated keys and values for every layer: (n_layer, B, H, L, D) views each. The kernels
    write it: prefill attention (k_out, v_out) and each decode step's attention (k_new, v_new).
    They read it through its strides, so its layout in memory is free (decode_plan.CACHE_LAYOUT):
    "heads" stores each (row, head)'s L positions together, "positions" each position's rows and
    heads together (L, B, H, D), so a short context's positions lie in one dense block. pad:
    unused positions after the L (decode_plan.CACHE_PAD). None: the plan's."""

    LAYOUTS = plan.CACHE_LAYOUTS

    def __init__(self, n_layer, batch, n_head, max_len, head_dim, dtype, device, pad=None, layout=None):
        shape, order = self.storage(n_layer, batch, n_head, max_len, head_dim, pad, layout)
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device).permute(order)[:, :, :, :max_len]
                          for _ in range(2))

    @classmethod
    def storage(cls, n_layer, batch, n_head, max_len, head_dim, pad=None, layout=None):
        """(shape, order): one of k's and v's allocations, in memory order, and the permutation
        that views it as (n_layer, B, H, L + pad, D). Nothing is allocated."""
        pad = plan.CACHE_PAD if pad is None else pad
        layout = plan.CACHE_LAYOUT if layout is None else layout
        if pad < 0:
            raise ValueError(f"pad: expected cache positions >= 0, got {pad}")
        if layout not in cls.LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(cls.LAYOUTS)}, got {layout!r}")
        if layout == "heads":
            return (n_layer, batch, n_head, max_len + pad, head_dim), (0, 1, 2, 3, 4)
        return (n_layer, max_len + pad, batch, n_head, head_dim), (0, 2, 3, 1, 4)  # (n_layer, L, B, H, D)

    @property
    def batch(self):
        return self.k.shape[1]

    @property
    def max_len(self):
        return self.k.shape[3]

    @property
    def nbytes(self):
        return 2 * self.k.untyped_storage().nbytes()  # as allocated, padding included

    def layer(self, layer, batch, length=None):
        """(k, v) views (batch, H, length, D) of one layer: the first `batch` rows and positions."""
        return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, :length]


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
        self.fc = folded(w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"], *ln_2)             # (C, F)
        self.mlp_proj = (out_major(w[p + "mlp.c_proj.weight"]), w[p + "mlp.c_proj.bias"])    # (F, C); F: 4C


def check_backend(backend, config=None):
    """That the backend exists and, given a config, runs that model: one ValueError naming what it
    cannot (LLM calls this before it reads the config, and again before it loads the weights)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {backend!r}")
    if config is not None and backend == "triton" and config.head_dim > kernels.MAX_HEAD_DIM:
        raise ValueError(f"backend: triton's attention takes heads up to {kernels.MAX_HEAD_DIM} wide, and this "
                         f"model's are {config.head_dim} (n_embd {config.n_embd} / n_head {config.n_head}); "
                         "backend torch runs it")


class GPT:
    def __init__(self, config, weights, backend="triton"):
        check_backend(backend, config)
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

    def new_cache(self, batch, max_len=None, pad=None, layout=None):
        c = self.config
        return KVCache(c.n_layer, batch, c.n_head, max_len or c.n_positions, c.head_dim, self.dtype, self.device,
                       pad, layout)

    def cache_nbytes(self, batch):
        """What new_cache(batch) allocates, in bytes (its padding included), without allocating it."""
        c = self.config
        shape, _ = KVCache.storage(c.n_layer, batch, c.n_head, c.n_positions, c.head_dim)
        return 2 * math.prod(shape) * self.wte.element_size()

    # Every kernel that writes the residual stream x also leaves its rows' partial statistics
    # (stats_out); the next layernorm-folded linear reads those (ln_stats) instead of whole rows.
    def _ln_linear(self, x, weights, stats, **kw):
        w, b, colsum = weights
        return self.ops.linear(x, w, b, ln_fold=colsum, ln_eps=self.config.layer_norm_epsilon, ln_stats=stats, **kw)

    # early: the roles (plan.early_roles) that let the next kernel launch at their start
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

    def prefill(self, ids, seq_lens, cache, all_logits=False, argmax_keys=None):
        """Run right-padded prompts ids (B, T) with lengths seq_lens (B,) through the model,
        filling cache positions 0..T. Returns logits (B, V) at each prompt's last token, or
        (B, T, V) at every position with all_logits. argmax_keys: as decode's (the keys of the
        last tokens' logits max-ed in; logits None where the head writes the keys alone)."""
        if all_logits and argmax_keys is not None:
            raise ValueError("argmax_keys: expected None with all_logits (keys are for the last tokens)")
        c, ops = self.config, self.ops
        B, T = ids.shape
        H, D, C = c.n_head, c.head_dim, c.n_embd
        pos = torch.arange(T, device=ids.device, dtype=torch.int32).repeat(B)
        st_a, st_b = ops.prefill_row_stats(B * T, C, ids.device), ops.prefill_row_stats(B * T, C, ids.device)
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
        return self._logits(last, argmax_keys=argmax_keys)

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
        cuda_core = st_a is None  # the layer linears on the CUDA-core GEMV (which ask L2 ahead: decode_plan)
        early = plan.early_roles(B, cuda_core=cuda_core, width=C)
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
                w_o = (plan.l2_part(blk.attn_proj[0], C),) if cuda_core else ()
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
                                          tma_stages=plan.attention_tma_stages(B, C),
                                          l2_ahead=(plan.l2_part(blk.fc[0], C), plan.l2_part(blk.mlp_proj[0], C))
                                          if cuda_core else ())
            x = self._mlp(blk, x, st_attn, st_a, early,
                          l2_ahead=self._next_weight(i, screened) if cuda_core else ())
        return self._logits(x, st_a, argmax_keys)

    def _next_weight(self, i, screened):
        """What layer i's mlp-out asks L2 for (one row on the CUDA-core GEMV), as l2_ahead: the next
        layer's qkv weights, or after the last layer the lm_head's first columns: of its int8
        copy where the screened head runs (plan.L2_SCREEN_BYTES; none for 0)."""
        if i + 1 < len(self.blocks):
            return (plan.l2_part(self.blocks[i + 1].attn[0], self.config.n_embd),)
        if screened:
            q = self.lm_screen.q  # (V, C // 4) int32 words: a column's bytes contiguous
            rows = plan.L2_SCREEN_BYTES // (q.shape[1] * 4)
            return (q[:rows],) if rows else ()
        return (plan.first_columns(self.lm_head[0], plan.L2_LM_HEAD_BYTES),)  # (C, V), out-major

    def _screened(self, B, argmax_keys):
        """Whether this step's lm_head is the screened head (kernels.vocab_screen)."""
        return argmax_keys is not None and B == 1 and self.lm_screen is not None
