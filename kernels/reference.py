"""Plain-torch versions of every kernel in this package.

They define what the Triton kernels must compute: the tests compare against them (upcast to
fp32/fp64), the benchmark uses them as the eager baseline, and the runtime's CPU backend
(`backend="torch"`) runs on them. Signatures match the Triton launchers one to one.
"""
import math

import torch
import torch.nn.functional as F

from ._epilogue import FIXED_SQ_UNIT, FIXED_SUM_UNIT  # the fixed-point statistics' units
from .argmax_key import EMPTY, argmax_index, row_keys  # the key format (plain torch)

ACTIVATIONS = (None, "gelu_tanh", "gelu", "relu", "leaky_relu")


def _into(y, out):
    return y if out is None else out.copy_(y)


def layernorm(x, weight, bias, eps=1e-5, out=None):
    return _into(F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype), out)


def add_layernorm(x, residual, weight, bias, eps=1e-5, out=None, sum_out=None):
    """(h, layernorm(h)) with h = x + residual rounded to x's dtype, as the unfused ops round it."""
    h = _into((x.float() + residual.float()).to(x.dtype), sum_out)
    return h, layernorm(h, weight, bias, eps, out)


_ACTIVATION_FNS = {"gelu_tanh": lambda y, _: F.gelu(y, approximate="tanh"), "gelu": lambda y, _: F.gelu(y),
                   "relu": lambda y, _: F.relu(y), "leaky_relu": F.leaky_relu}


def apply_activation(y, name, negative_slope=0.01):
    if name is None:
        return y
    if name not in _ACTIVATION_FNS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {name!r}")
    return _ACTIVATION_FNS[name](y, negative_slope)


STATS_GROUP = 16


def new_row_stats(rows, cols, device):
    return torch.empty((rows, 2, -(-cols // STATS_GROUP)), dtype=torch.float32, device=device)


decode_row_stats = prefill_row_stats = new_row_stats  # the reference's linears all take statistics


def fixed_row_stats(layers, rows, n, cache_len, head_dim, heads, dtype, device):  # None: fp32 statistics everywhere
    return None


def fixed_stats_values(stats):
    """The fixed-point form (int64, kernels._epilogue) as the float64 sums it stands for."""
    units = torch.tensor([FIXED_SUM_UNIT.value, FIXED_SQ_UNIT.value], dtype=torch.float64, device=stats.device)
    return stats.double() * units[:, None]


def row_stats(y):
    """The partial statistics (rows, 2, groups) fp32 the kernels pass to a following layernorm:
    each row of y (..., N)'s sums and sums of squares per STATS_GROUP columns."""
    yf = y.reshape(-1, y.shape[-1]).float()
    rows, n = yf.shape
    groups = -(-n // STATS_GROUP)
    g = F.pad(yf, (0, groups * STATS_GROUP - n)).view(rows, groups, STATS_GROUP)
    return torch.stack([g.sum(-1), (g * g).sum(-1)], dim=1)


def fold_layernorm(weight, bias, ln_weight, ln_bias):
    """A layernorm folded into the linear after it (`linear(ln_fold=...)`): layernorm(x) @ W + c =
    rstd * (x @ (g * W) - mean * colsum(g * W)) + (b @ W + c); W (K, N), c (N,) or None, g, b (K,).
    Returns (g * W in W's dtype and layout, b @ W + c and colsum in fp32). colsum is of the rounded
    g * W, so the mean's share cancels exactly; b @ W is summed in fp64, as fp32 BLAS rounds a
    column by where it sits and would untie equal columns' logits."""
    folded = torch.empty_like(weight).copy_(ln_weight.float()[:, None] * weight.float())  # W's strides
    shift = (ln_bias.double() @ weight.double()).float()
    if bias is not None:
        shift = shift + bias.float()
    return folded, shift, folded.double().sum(0).float()  # colsum


def _mean_rstd(x, stats, eps):
    """Each row's mean and 1/std (..., 1), from its partial statistics or from the row."""
    K = x.shape[-1]
    if stats is None:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
    else:
        if stats.dtype == torch.int64:
            stats = fixed_stats_values(stats)
        total = stats.to(x.dtype).sum(-1).view(*x.shape[:-1], 2)
        mean = total[..., 0:1] / K
        var = (total[..., 1:2] / K - mean * mean).clamp_min(0)
    return mean, torch.rsqrt(var + eps)


def linear(x, weight, bias=None, activation=None, residual=None, negative_slope=0.01,
           ln_fold=None, ln_eps=1e-5, out=None, ln_stats=None, stats_out=None, argmax_keys=None,
           prefetch_residual=False, early_launch=False, l2_ahead=(), keys_only=False):
    """act(x @ weight + bias) + residual in fp32 (fp64 for fp64 inputs), returned in x's dtype.
    With ln_fold (fold_layernorm's column sums) the product is rstd * (x @ weight - mean * ln_fold),
    mean and variance from ln_stats' partial statistics or from x. stats_out gets row_stats of the
    output; argmax_keys is max-ed with each row's argmax key (kernels.argmax_key); keys_only: no return."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf @ weight.to(xf.dtype)
    if ln_fold is not None:
        mean, rstd = _mean_rstd(xf, ln_stats, ln_eps)
        y = (y - mean * ln_fold.to(xf.dtype)) * rstd
    if bias is not None:
        y = y + bias.to(xf.dtype)
    y = apply_activation(y, activation, negative_slope)
    if residual is not None:
        y = y + residual.to(xf.dtype)
    y = _into(y.to(x.dtype), out)
    if stats_out is not None:
        stats_out.copy_(row_stats(y))
    if argmax_keys is not None:
        torch.maximum(argmax_keys, row_keys(y), out=argmax_keys)
    return None if keys_only else y


def screen_head(weight, bias, colsum):  # no screened head here: greedy argmax from the full logits
    return None


def screened_argmax(x, weight, bias, ln_fold, ln_eps, screen, argmax_keys, x_unit=None):
    """The screened head's result (kernels.vocab_screen) from the full logits: linear(x, ...)'s argmax
    keys max-ed into argmax_keys. x_unit: x is int32 fixed-point words of that many each."""
    x = x if x_unit is None else x.float() * x_unit
    linear(x, weight, bias, ln_fold=ln_fold, ln_eps=ln_eps, argmax_keys=argmax_keys)


def attention(q, k, v, causal=True, scale=None, seq_lens=None, out=None, k_out=None, v_out=None):
    """q, k, v: (B, H, T, D). Keys at positions >= seq_lens[b] are masked out (right padding).
    k_out, v_out (B, H, T, D): receive copies of k and v (a KV cache's prefill rows)."""
    B, H, T, D = q.shape
    _into(k, k_out)
    _into(v, v_out)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, H, T, T)
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool, device=q.device)
    if causal:
        mask |= torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    if seq_lens is not None:
        mask |= (torch.arange(T, device=q.device)[None, :] >= seq_lens.to(q.device)[:, None])[:, None, None, :]
    s = s.masked_fill(mask, float("-inf"))
    return _into((torch.softmax(s, dim=-1) @ v.float()).to(q.dtype), out)


def decode_attention(q, k_cache, v_cache, seq_lens, scale=None, k_new=None, v_new=None, out=None,
                     num_splits=None, prefetch_cache=False, tma_stages=None, _config=None):
    """q: (B, H, D); caches: (B, H, L, D); query b attends to its first seq_lens[b] keys.
    k_new, v_new (B, H, D) are first written to cache position seq_lens[b] - 1."""
    B, H, D = q.shape
    if k_new is not None:
        rows = torch.arange(B, device=q.device)
        k_cache[rows, :, seq_lens.long() - 1] = k_new.to(k_cache.dtype)
        v_cache[rows, :, seq_lens.long() - 1] = v_new.to(v_cache.dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhd,bhld->bhl", q.float(), k_cache.float()) * scale
    keys = torch.arange(k_cache.shape[2], device=q.device)
    hidden = (keys[None, :] >= seq_lens.to(q.device)[:, None])[:, None, :]  # (B, 1, L)
    s = s.masked_fill(hidden, float("-inf"))
    v = v_cache.float().masked_fill(hidden[..., None], 0.0)  # unwritten cache rows may hold NaN
    return _into(torch.einsum("bhl,bhld->bhd", torch.softmax(s, dim=-1), v).to(q.dtype), out)


def decode_attention_proj(q, k_cache, v_cache, seq_lens, k_new, v_new, weight, bias, residual, out=None,
                          stats_out=None, scale=None, prefetch=False, early_launch=False, positions=None,
                          l2_ahead=(), tma_stages=None, _layout=None):
    """residual + decode_attention(q, ..., k_new=, v_new=) @ weight + bias, (B, N). positions,
    l2_ahead and tma_stages only steer the kernel's reads: none changes the result."""
    B, H, D = q.shape
    attn = decode_attention(q, k_cache, v_cache, seq_lens, scale, k_new, v_new)
    return linear(attn.reshape(B, H * D), weight, bias, residual=residual, out=out, stats_out=stats_out)


def _table_rows(table, index):  # fp32; zeros outside the table, as the kernel reads them
    inside = (index >= 0) & (index < table.shape[0])
    return torch.where(inside[:, None], table[index.clamp(0, table.shape[0] - 1).long()].float(), 0.0)


def embedding(ids, pos, wte, wpe, out=None, stats_out=None, lens_out=None):
    y = _into((_table_rows(wte, ids) + _table_rows(wpe, pos)).to(wte.dtype), out)
    if stats_out is not None:
        stats_out.copy_(row_stats(y))
    if lens_out is not None:  # no pos + 1 to allocate per token otherwise
        lens_out.copy_(pos + 1)
    return y


def embedding_linear(ids, pos, wte, wpe, weight, bias=None, ln_fold=None, ln_eps=1e-5, stats=None, lens_out=None,
                     early_launch=False):
    x = embedding(ids, pos, wte, wpe, stats_out=stats, lens_out=lens_out)
    return x, linear(x, weight, bias, ln_fold=ln_fold, ln_eps=ln_eps, ln_stats=stats)


def softmax(x):
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def gelu(x, approximate="tanh"):
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def append_tokens(next_ids, out, step, tokens, pos, from_keys=False, noise=None, out_host=None):
    if noise is not None:
        noise.state[1:].add_(noise.increment)
    if from_keys:
        keys, next_ids = next_ids, argmax_index(next_ids)
        keys.fill_(EMPTY)
    out.index_copy_(1, step, next_ids[:, None])
    if out_host is not None:  # the whole of out: the column's index is on the device
        out_host.copy_(out, non_blocking=True)
    tokens.copy_(next_ids)
    pos.add_(1)
    step.add_(1)
    return out


SAMPLE_MAX_TOP_K = 2 ** 62  # plain torch takes any top_k


def sampling_scores(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, seen=None):
    """transformers' logits processors, its order and formulas: repetition penalty (on the columns
    seen (B, V) marks), temperature, top-k (below the k-th largest masked, ties kept), top-p (the
    ascending softmax cumsum <= 1 - top_p masked, the largest kept). (B, V) -> fp32, -inf masked."""
    scores = logits.float()
    if penalty != 1.0 and seen is not None:
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, stable=True)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False  # keep at least one token
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_logits(logits, q, top_k, temperature=1.0, top_p=1.0, penalty=1.0, seen=None, out=None):
    """Token ids (B,) int64: argmax(softmax(sampling_scores(...)) / q) with q (B, V) ~ Exp(1),
    the draw torch.multinomial(p, 1) makes (or an ExponentialNoise: torch's values, see
    exponential). A row whose softmax has NaNs names no token: id V. A NaN logit makes them, as do
    scores of +inf (a temperature or penalty too small for the logits) or of -inf throughout:
    transformers' draw raises there."""
    if not isinstance(q, torch.Tensor):
        q = exponential(q, logits.shape)
    probs = torch.softmax(sampling_scores(logits, temperature, top_k, top_p, penalty, seen), dim=-1)
    return _into(no_token_if_nan(probs, (probs / q).argmax(dim=-1)), out)


def no_token_if_nan(rows, ids):  # a row (of logits or probabilities) holding a NaN names no token: id V
    return torch.where(torch.isnan(rows).any(dim=-1), rows.shape[-1], ids)


def _mul_hi_lo(a, b):
    """(a * b) >> 32 and (a * b) mod 2^32 of 32-bit values held in int64 (no 64-bit overflow)."""
    p_lo, p_hi = (a & 0xFFFF) * b, (a >> 16) * b  # each < 2^48
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & 0xFFFFFFFF


def _philox4x32_10(c, key):
    """curand's Philox4x32-10 of counters c (4 int64 tensors of 32-bit words) and key (2 ints)."""
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(c[0], 0xD2511F53)
        hi1, lo1 = _mul_hi_lo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def exponential(noise, shape, out=None):
    """The float32 draw torch's CUDA exponential_(1) makes for a fresh tensor of shape from
    noise.state = (seed bits, offset): torch's own on CUDA; elsewhere the same Philox words in
    noise's layout (kernels/noise.py), with an accurate log for CUDA's __logf (a few ulps off)."""
    seed, offset = (int(v) for v in noise.state.tolist())
    seed &= (1 << 64) - 1
    if noise.state.device.type == "cuda":
        g = torch.Generator(noise.state.device).manual_seed(seed)
        g.set_offset(offset)
        return _into(torch.empty(shape, device=noise.state.device).exponential_(1, generator=g), out)
    flat = torch.arange(math.prod(shape), dtype=torch.int64, device=noise.state.device)
    call, word, thread = flat // (4 * noise.threads), (flat // noise.threads) % 4, flat % noise.threads
    ctr = offset // 4 + call
    r = _philox4x32_10([ctr & 0xFFFFFFFF, ctr >> 32, thread & 0xFFFFFFFF, thread >> 32],
                       (seed & 0xFFFFFFFF, seed >> 32))
    r = torch.stack(r).gather(0, word[None])[0]
    u = r.float() * 2.0 ** -32 + 2.0 ** -33  # the product is exact, so no FMA question
    q = torch.where(u >= 1 - 2.0 ** -24, torch.full_like(u, 2.0 ** -24), -torch.log(u))
    return _into(q.view(shape), out)
