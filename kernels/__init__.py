"""minillm's Triton kernels. Every op has a plain-torch twin in `kernels.reference`.

- layernorm / add_layernorm: LayerNorm over the last dim, optionally fused with a residual add
- linear: act(x @ W + bias) + residual in one kernel, with a layernorm folded in (fold_layernorm:
  the gain and shift go into W and bias, the normalization into the epilogue); split-K path for
  decode rows, a whole-slab path past 32 rows of K <= 768, a CUDA-core path for one row
- decode_row_stats / prefill_row_stats: new_row_stats for a decode step or a prefill, or None where
  its linears need none
- attention: fused causal/full prefill attention with online softmax, per-sequence lengths
- decode_attention: split-K (flash-decoding) attention of one query over a KV cache
- decode_attention_proj: decode attention and the output projection (+ residual) in one launch
  for few rows and a short cache; fixed_row_stats: its statistics buffers in fixed point, where
  its one-atomic merge takes them
- embedding: token + position embedding gather; embedding_linear: a decode step's embedding
  and first linear, one launch where that linear runs one row on CUDA cores
- append_tokens: a decode step's bookkeeping (record the new ids, advance positions) in one launch
- screen_head / screened_argmax: greedy decoding's argmax at one row from an int8 copy of the
  vocabulary head, the full head's key from about half its bytes
- argmax_key: greedy decoding's argmax as int64 keys one atomic max combines (linear's argmax_keys)
- new_row_stats: a buffer for the partial row statistics (stats_out / ln_stats) that let a
  folded layernorm skip reading whole rows
- sample_logits: a sampled step's logits processing and draw (top-k from 1 to
  SAMPLE_MAX_TOP_K), transformers' formulas, in one launch (two past
  MAX_MERGED_ROWS rows); its k-th values come from kth_search (a bit-by-bit count, no sort)
- exponential / ExponentialNoise: torch's CUDA exponential_ values from the generator's state,
  so the sampler computes its noise at the drawn columns only (torch_exponential_matches checks)
- softmax, gelu: row softmax and elementwise GELU
- compile_ahead: a dry pass in which launches compile their kernels in threads, all at once,
  and run nothing (so a process's first step does not wait for its compilations one by one)
"""
from ._epilogue import new_row_stats
from ._screen_head import screen_head
from ._tuning import compile_ahead
from . import argmax_key
from .activations import ACTIVATIONS, gelu
from .attention import MAX_HEAD_DIM, attention
from .decode_attention import decode_attention
from .decode_attention_proj import decode_attention_proj
from .decode_attention_proj_config import fixed_row_stats
from .decode_step import append_tokens
from .embedding import embedding
from .gemv_fma import decode_row_stats
from .layernorm import add_layernorm, layernorm
from .linear import embedding_linear, linear, prefill_row_stats
from .noise import ExponentialNoise, exponential, new_exponential_noise, torch_exponential_matches
from .reference import fold_layernorm
from .sampling import MAX_TOP_K as SAMPLE_MAX_TOP_K
from .sampling import sample_logits
from .softmax import softmax
from .vocab_screen import screened_argmax

__all__ = ["ACTIVATIONS", "MAX_HEAD_DIM", "add_layernorm", "append_tokens", "argmax_key", "attention",
           "compile_ahead", "decode_attention", "decode_attention_proj", "decode_row_stats", "embedding",
           "embedding_linear", "exponential", "ExponentialNoise", "fixed_row_stats", "fold_layernorm", "gelu",
           "layernorm", "linear", "new_exponential_noise", "new_row_stats", "prefill_row_stats",
           "SAMPLE_MAX_TOP_K", "sample_logits", "screen_head", "screened_argmax", "softmax",
           "torch_exponential_matches"]
__version__ = "0.1.0"
