"""scripts/profile_decode.py's bookkeeping on made-up kernel records (no GPU): roles in launch
order and each kernel's share of a step's critical path."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_decode)


def kernel(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_roles_follow_launch_order():
    names = ["_embedding_kernel", "_gemv_fma_kernel", "_decode_attention_kernel", "_gemv_fma_kernel",
             "_gemv_kernel", "_gemv_kernel", "_gemv_kernel", "_append_tokens_kernel"]
    assert profile_decode.label(names, n_layer=1) == [
        "embedding", "qkv", "decode_attention", "attn-out", "fc", "mlp-out", "lm_head", "append_tokens"]


def test_whole_slab_linears_take_their_positions():
    # past 32 rows qkv, attn-out and fc run gemv_slab.py's kernel, mlp-out and the lm_head gemv.py's
    names = ["_embedding_kernel", "_gemv_slab_kernel", "_decode_attention_kernel", "_gemv_slab_kernel",
             "_gemv_slab_kernel", "_gemv_kernel", "_gemv_kernel", "_append_tokens_kernel"]
    assert profile_decode.label(names, n_layer=1) == [
        "embedding", "qkv", "decode_attention", "attn-out", "fc", "mlp-out", "lm_head", "append_tokens"]


def test_fused_attention_projection_takes_attn_outs_place():
    names = ["_embedding_kernel", "_gemv_kernel", "_decode_attention_proj_kernel", "_gemv_kernel", "_gemv_kernel",
             "_gemv_kernel", "_decode_attention_proj_kernel", "_gemv_kernel", "_gemv_kernel", "_vocab_fma_kernel"]
    assert profile_decode.label(names, n_layer=2) == [
        "embedding", "qkv", "attention+attn-out", "fc", "mlp-out", "qkv", "attention+attn-out", "fc", "mlp-out",
        "lm_head"]


def test_screened_head_takes_the_lm_heads_place():
    names = ["_embedding_kernel", "_gemv_fma_kernel", "_decode_attention_proj_kernel", "_gemv_fma_kernel",
             "_gemv_fma_kernel", "_vocab_screen_kernel", "_append_tokens_kernel"]
    assert profile_decode.label(names, n_layer=1) == [
        "embedding", "qkv", "attention+attn-out", "fc", "mlp-out", "lm_head", "append_tokens"]


def test_embedding_folded_into_the_first_qkv():
    # one row of gpt2's size: kernels.embedding_linear gathers the embedding in layer 0's qkv
    names = ["_gemv_fma_kernel", "_decode_attention_proj_kernel", "_gemv_fma_kernel", "_gemv_fma_kernel",
             "_vocab_screen_kernel", "_append_tokens_kernel"]
    assert profile_decode.label(names, n_layer=1) == [
        "qkv", "attention+attn-out", "fc", "mlp-out", "lm_head", "append_tokens"]


def test_critical_shares_add_up_to_each_step():
    # two steps of three kernels; the second starts early (dependent launch) and the third ends
    # before the second: its share is zero, and the shares add up to first start -> last end
    step = [kernel("a", 0.0, 2.0), kernel("b", 1.0, 5.0), kernel("c", 3.0, 4.5)]
    later = [kernel(k.name, k.time_range.start + 10, k.time_range.end + 10) for k in step]
    rows = profile_decode.critical_shares(step + later, per_step=3)
    assert [r[0] for r in rows] == [0, 1, 2, 0, 1, 2]
    assert [r[2] for r in rows[:3]] == pytest.approx([2.0, 3.0, 0.0])
    assert sum(r[2] for r in rows[3:]) == pytest.approx(5.0)
    assert rows[1][3] == pytest.approx(-1.0)  # started 1 us before the first one ended


def test_step_gaps_between_replays():
    # three steps of two kernels; the second kernel of each ends last, the next step starts 1.5
    # and then 0.5 us after it
    steps = [kernel("a", 0.0, 2.0), kernel("b", 1.0, 5.0), kernel("a", 6.5, 8.0), kernel("b", 7.0, 9.0),
             kernel("a", 9.5, 10.0), kernel("b", 9.8, 11.0)]
    assert profile_decode.step_gaps(steps, per_step=2) == pytest.approx([1.5, 0.5])
