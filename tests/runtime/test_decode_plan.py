"""The decode step's launch plan (minillm/decode_plan.py): the early roles by rows, GEMV kind and
width, the L2 requests' caps, decode attention's stages, the cache's layout and pad, their
environment switches, and the model's decode step following them."""
import os
import subprocess
import sys

import pytest
import torch

import minillm.decode_plan
from kernels._l2_ahead import l2_ranges
from minillm import LLM, SamplingParams
from minillm.decode_plan import (L2_WIDE_CAP, attention_tma_stages, early_roles, l2_part, mb_from_env,
                                 positions_from_env, roles_from_env)
from minillm.model import KVCache
from tests.models import build_checkpoint


def test_early_roles_rule_and_its_switch(monkeypatch):
    """The decode linears that launch the next kernel at their start, by rows, GEMV kind and
    model width (early_roles' docstring has the timings), and MINILLM_EARLY_ROLES's values: any of the four
    roles, or none; anything else is one error naming the variable."""
    monkeypatch.setattr(minillm.decode_plan, "EARLY_ROLES_ENV", None)
    assert early_roles(1, cuda_core=True, width=768) == {"fc", "qkv", "mlp-out"}
    assert early_roles(1, cuda_core=False, width=1600) == {"attn-out", "fc", "mlp-out"}
    assert early_roles(4, cuda_core=False, width=768) == {"attn-out", "mlp-out"}
    assert early_roles(8, cuda_core=False, width=1600) == {"qkv", "mlp-out"}
    assert early_roles(9, cuda_core=False, width=768) == early_roles(16, cuda_core=False, width=768) == {"mlp-out"}
    assert early_roles(16, cuda_core=False, width=1280) == {"mlp-out", "attn-out"}
    assert early_roles(16, cuda_core=False, width=1600) == {"attn-out"}
    assert early_roles(16, cuda_core=False, width=1024) == early_roles(16, cuda_core=False, width=64) == frozenset()
    assert early_roles(17, cuda_core=False, width=768) == early_roles(32, cuda_core=False, width=768) == {"qkv"}
    assert early_roles(33, cuda_core=False, width=768) == frozenset()
    assert early_roles(32, cuda_core=False, width=1024) == frozenset()  # gpt2-medium and wider
    assert early_roles(64, cuda_core=False, width=768) == frozenset()
    assert roles_from_env(None) is None
    assert roles_from_env("none") == frozenset() and roles_from_env("") == frozenset()
    assert roles_from_env("fc+qkv") == roles_from_env("qkv,fc") == {"fc", "qkv"}
    monkeypatch.setattr(minillm.decode_plan, "EARLY_ROLES_ENV", roles_from_env("attn-out,qkv"))
    assert early_roles(1, cuda_core=True, width=768) == {"attn-out", "qkv"}
    assert early_roles(64, cuda_core=False, width=1600) == {"attn-out", "qkv"}
    with pytest.raises(ValueError, match=r"^MINILLM_EARLY_ROLES: expected none or roles of qkv, attn-out, fc, "
                                         r"mlp-out split by commas or \+, got 'fc,gelu'$"):
        roles_from_env("fc,gelu")



def test_l2_screen_switch():
    """MINILLM_L2_SCREEN_MB: 4 MB unset, whole MB (0: none) when set, one error naming it otherwise."""
    assert mb_from_env(None) == mb_from_env("") == mb_from_env("4") == 4 << 20
    assert mb_from_env("0") == 0 and mb_from_env("12") == 12 << 20
    for bad in ("-1", "4.5", "four"):
        with pytest.raises(ValueError, match=r"^MINILLM_L2_SCREEN_MB: expected a whole number of MB"):
            mb_from_env(bad)



def test_l2_requests_capped_past_gpt2_width(monkeypatch):
    """Past gpt2's width a layer weight is asked for only up to its first L2_WIDE_CAP bytes (its
    first columns, a dense view: l2_ranges' requirement); at gpt2's width whole."""
    for K, N in [(1600, 6400), (6400, 1600)]:
        w = torch.randn(N, K, dtype=torch.float16).t()  # out-major (K, N)
        part = l2_part(w, 1600)
        assert part.data_ptr() == w.data_ptr() and part.shape[0] == K
        assert L2_WIDE_CAP - K * 2 < part.numel() * 2 <= L2_WIDE_CAP
        assert l2_ranges("t", (part,), part.device)[0][1] == part.numel() * 2
    w = torch.randn(3072, 768, dtype=torch.float16).t()
    assert l2_part(w, 768) is w
    monkeypatch.setattr(minillm.decode_plan, "L2_CAP_ENV", 0)  # MINILLM_L2_AHEAD_MB=0: nothing asked for
    assert l2_ranges("t", (l2_part(w, 768),), w.device)[0][1] == 0


def test_attention_tma_stages_rule():
    """In the batch bucket of 64 (33-64 rows) gpt2-medium's width keeps 4 descriptor tiles in flight
    and gpt2's 2; every other width and row count leaves the kernel's 3 (None)."""
    assert attention_tma_stages(33, 1024) == attention_tma_stages(64, 1024) == 4
    assert attention_tma_stages(33, 768) == attention_tma_stages(64, 768) == 2
    assert all(attention_tma_stages(rows, width) is None for rows in (32, 65) for width in (768, 1024))
    assert all(attention_tma_stages(rows, width) is None for rows in (1, 24, 48, 64) for width in (1280, 1600))


@pytest.mark.parametrize("cuda_core", [True, False])
def test_qkv_asks_l2_for_its_layers_attention_projection(tmp_path, cuda_core):
    """Where the layer linears run the CUDA-core GEMV (one row, gpt2 to gpt2-xl: no statistics
    buffers), each decode step's qkv from layer 1 on asks L2 for its layer's W_o, which the
    attention launch after it reads before its wait; elsewhere (and in prefill) qkv asks for
    nothing. The plain-torch backend with the kernels' buffer rule stood in."""
    build_checkpoint(tmp_path, seed=5, n_layer=3, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    llm = LLM(str(tmp_path), dtype="float32", backend="torch", cuda_graphs=False)
    model = llm.engine.model
    ops, asked = model.ops, []

    class Spy:  # the backend, with decode_row_stats as the kernels' at gpt2's size, and linear's l2_ahead noted
        def __getattr__(self, name):
            return getattr(ops, name)

        def decode_row_stats(self, rows, cols, device):
            return None if cuda_core and rows == 1 else ops.decode_row_stats(rows, cols, device)

        def linear(self, x, w, *args, l2_ahead=(), **kw):
            asked.append((w, tuple(l2_ahead)))
            return ops.linear(x, w, *args, **kw)

    model.ops = Spy()
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    for i, blk in enumerate(model.blocks):
        qkv = [ahead for w, ahead in asked if w is blk.attn[0]]
        assert qkv, f"layer {i}'s qkv never ran through linear"
        if cuda_core and i:  # prefill's, then two decode steps'
            assert len(qkv) == 3 and qkv[0] == (), (i, qkv)
            assert all(len(a) == 1 and a[0] is blk.attn_proj[0] for a in qkv[1:]), (i, qkv)
        else:  # layer 0's decode qkv gathers the embedding (embedding_linear): only prefill's here
            assert all(a == () for a in qkv), (i, qkv)


def test_decode_attention_gets_the_plans_stages(tmp_path, monkeypatch):
    """Each decode step's attention launch gets decode_plan.attention_tma_stages for its rows and
    the model's width (here a rule for width 32 stood in for gpt2-medium's): 4 at 33 rows, None
    (the kernel's own) at 3. The plain-torch backend stood in."""
    build_checkpoint(tmp_path, seed=6, n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    monkeypatch.setattr(minillm.decode_plan, "ATTN_TMA_STAGES_64_ROWS", {32: 4})
    llm = LLM(str(tmp_path), dtype="float32", backend="torch", cuda_graphs=False)
    ops, got = llm.engine.model.ops, []

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        def decode_attention_proj(self, q, *args, tma_stages=None, **kw):
            got.append((q.shape[0], tma_stages))
            return ops.decode_attention_proj(q, *args, **kw)

    llm.engine.model.ops = Spy()
    for rows, stages in ((33, 4), (3, None)):
        got.clear()
        llm.generate([[1, 2, 3]] * rows, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
        assert got and set(got) == {(rows, stages)}, got


def test_cache_switches():
    """MINILLM_CACHE_PAD: none unset, whole positions when set, one error naming it otherwise;
    MINILLM_CACHE_LAYOUT's one error at import; KVCache's own refusals."""
    assert positions_from_env(None) == positions_from_env("") == 0
    assert positions_from_env("16") == 16
    for bad in ("-8", "1.5", "eight"):
        with pytest.raises(ValueError, match=r"^MINILLM_CACHE_PAD: expected a whole number of cache positions"):
            positions_from_env(bad)
    with pytest.raises(ValueError, match=r"^pad: expected cache positions >= 0, got -1$"):
        KVCache(1, 1, 1, 4, 8, torch.float16, "cpu", pad=-1)
    with pytest.raises(ValueError, match=r"^layout: expected one of heads, positions, got 'rows'$"):
        KVCache(1, 1, 1, 4, 8, torch.float16, "cpu", layout="rows")
    done = subprocess.run([sys.executable, "-c", "import minillm.decode_plan"], capture_output=True, text=True,
                          env={**os.environ, "MINILLM_CACHE_LAYOUT": "rows"}, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1] == \
        "ValueError: MINILLM_CACHE_LAYOUT: expected heads or positions, got 'rows'"


@pytest.mark.parametrize("tma", [None, 1])
def test_cache_layouts_same_bits(tmp_path, monkeypatch, tma):
    """The cache's layouts in memory (decode_plan.CACHE_LAYOUT, CACHE_PAD, read by new_cache) give
    the kernels other strides and the same bits: prefill and three decode steps of two rows,
    logits and cache rows equal to the unpadded "heads" layout's. The Triton backend (on the
    CPU, the interpreter): at two rows the fused attention launch (tma None); with tma=1 decode
    attention apart, its tiles by tensor descriptors over each layout's strides."""
    build_checkpoint(tmp_path, seed=7, n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    attention, described = sys.modules["kernels.decode_attention"], []
    if tma:
        monkeypatch.setattr(sys.modules["kernels.decode_attention_config"], "TMA_ENV", tma)
        monkeypatch.setattr(sys.modules["kernels.decode_attention_proj_config"], "FUSED", False)
        from_tensor = attention.TensorDescriptor.from_tensor
        monkeypatch.setattr(attention.TensorDescriptor, "from_tensor",
                            staticmethod(lambda t, block: described.append(t.stride()) or from_tensor(t, block)))
    m = LLM(str(tmp_path), dtype="float16", backend="triton", cuda_graphs=False).model
    dev, H, D = m.device, m.config.n_head, m.config.head_dim
    prompts = torch.tensor([[5, 17, 99, 3, 250], [42, 7, 1, 1, 1]], device=dev)
    lens = torch.tensor([5, 2], dtype=torch.int32, device=dev)
    runs = {}
    for layout, pad in (("heads", 0), ("heads", 24), ("positions", 0), ("positions", 8)):
        described.clear()
        monkeypatch.setattr(minillm.decode_plan, "CACHE_LAYOUT", layout)
        monkeypatch.setattr(minillm.decode_plan, "CACHE_PAD", pad)
        cache = m.new_cache(2, 48)
        assert cache.k.shape[1:] == (2, H, 48, D)
        run = (48 + pad) * D  # a (row, head)'s positions in "heads"
        assert cache.k.stride()[1:] == cache.v.stride()[1:] == (
            (H * D, D, 2 * H * D, 1) if layout == "positions" else (H * run, run, D, 1))
        assert cache.nbytes == 2 * m.config.n_layer * 2 * H * (48 + pad) * D * 2
        assert m.new_cache(3).nbytes == m.cache_nbytes(3)  # (what the out-of-memory message names)
        cache.k.fill_(float("nan"))  # positions no launch writes must never be read
        cache.v.fill_(float("nan"))
        logits = [m.prefill(prompts, lens, cache)]
        pos = lens.clone()
        for step in range(3):
            tokens = logits[-1].argmax(-1).to(torch.int32)
            logits.append(m.decode(tokens, pos, cache, 48))
            pos += 1
        assert all(t.isfinite().all() for t in logits), f"{layout}, pad {pad}: non-finite logits"
        assert bool(tma) == (cache.k[0].stride() in described), (layout, pad, described)
        runs[layout, pad] = logits, [cache.k[:, r, :, :p] for r, p in enumerate(pos.tolist())]
    (plain, plain_k) = runs.pop(("heads", 0))
    for key, (logits, k_rows) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(plain, logits)), key
        assert all(torch.equal(a, b) for a, b in zip(plain_k, k_rows)), key
