"""scripts/trace_decode.py without a GPU: its text patches (scripts/trace_patches.py) still apply
to the kernel files (each anchor once) and the traced copies import; its per-launch bookkeeping on made-up records."""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("trace_decode", ROOT / "scripts" / "trace_decode.py")
trace_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_decode)
trace_patches = sys.modules["trace_patches"]  # imported by the script, from scripts/


KERNELS = {"gemv": "_gemv_kernel", "gemv_slab": "_gemv_slab_kernel", "gemv_fma": "_gemv_fma_kernel",
           "decode_attention": "_decode_attention_kernel", "decode_attention_proj": "_decode_attention_proj_kernel",
           "vocab_fma": "_vocab_fma_kernel", "vocab_screen": "_vocab_screen_kernel"}


def _calls_in(tree, function):
    """Names of the functions called inside the top-level function `function`."""
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return [n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


@pytest.mark.parametrize("name", sorted(trace_patches.PATCHES))
def test_patches_apply_and_import(name, tmp_path):
    src = trace_patches.patched_source(name)
    assert src.count("\n    _record(trace_ptr") == 1 and src.count("t0 = _now()") == 1
    # inside the kernel, not in a function after it (gemv's record once landed in
    # weight_descriptor, after its return: no program wrote a record)
    calls = _calls_in(ast.parse(src), KERNELS[name])
    assert calls.count("_record") == 1 and calls.count("_now") >= 2
    mod = trace_decode.load_traced(name, tmp_path)
    assert "trace_ptr" in getattr(mod, KERNELS[name]).arg_names


def test_launch_shape_by_name(tmp_path):
    """A traced launch finds N and K by the kernel's argument names, positional or keyword."""
    fn = trace_decode.load_traced("gemv_fma", tmp_path)._gemv_fma_kernel
    traced = trace_decode._Traced(fn, "fma", ("N", "K"))
    args = list(range(len(fn.arg_names)))  # each positional argument's value is its index
    assert traced.shape(args, {"K": 768}) == (fn.arg_names.index("N"), 768)


def test_a_moved_anchor_is_named(monkeypatch):
    monkeypatch.setitem(trace_patches.PATCHES, "gemv", [("no such line\n", "")])
    with pytest.raises(RuntimeError, match="kernels/gemv.py has 0 copies of the anchor 'no such line'"):
        trace_patches.patched_source("gemv")


def _launch(kind, N, K, programs):
    """programs: (sm, start, weights, wait, end) in us, stored as the kernels do (ns)."""
    buf = torch.tensor([[p[0]] + [int(x * 1000) + 10**9 for x in p[1:]] for p in programs], dtype=torch.int64)
    return kind, N, K, buf.view(-1), len(programs)


def test_summarize_roles_times_and_overlap():
    C = 8
    launches = [
        _launch("fma", 3 * C, C, [(0, 0.0, 1.0, 1.0, 2.0), (1, 0.5, 1.5, 1.5, 2.5)]),
        _launch("attn", 2, 4, [(2, 1.0, 2.6, 2.6, 3.0)]),
        _launch("attn-proj", 2, 4, [(3, 1.1, 2.7, 2.7, 3.1)]),
        _launch("gemv", 100, C, [(0, 2.5, 3.5, 3.2, 4.0), (1, 2.6, 3.6, 3.3, 5.0), (2, 4.1, 4.5, 4.2, 4.8)]),
    ]
    out = trace_decode.summarize(launches, n_embd=C)
    assert [d["role"] for d in out] == ["qkv", "attention", "attention+attn-out", "lm_head"]
    qkv, attn, _, head = out
    assert qkv["start_first"] == pytest.approx(0.0) and qkv["end_last"] == pytest.approx(2.5)
    assert qkv["peak_alive"] == 2 and head["peak_alive"] == 2  # the third started after the first ended
    assert head["sms"] == 3 and head["wait_first"] == pytest.approx(3.2)
    assert head["programs_raw"][1] == [1, 2.6, 3.6, 3.3, 5.0]
    lines = trace_decode.report(out)
    row = next(line for line in lines if line.startswith("lm_head"))
    assert row.split()[1:3] == ["1", "-0.60"]  # started 0.6 us before the fused launch's last end
    row = next(line for line in lines if line.startswith("attention+attn-out"))
    assert row.split()[1:3] == ["1", "-1.90"]  # 1.1 us against the attention's end at 3.0


def test_summarize_drops_rows_no_program_wrote():
    """Rows left at the fill (-1), or with an SM id past MAX_SMS, are counted, not timed: they
    neither set the step's start nor a launch's times, and a launch with none valid stays in the
    list, empty."""
    C = 8
    qkv = _launch("fma", 3 * C, C, [(0, 0.0, 1.0, 1.0, 2.0), (1, 0.5, 1.5, 1.5, 2.5)])
    qkv[3].view(2, trace_decode.FIELDS)[1] = -1
    blank = _launch("attn", 2, 4, [(2, 1.0, 2.6, 2.6, 3.0)])
    blank[3].fill_(-1)
    head = _launch("gemv", 100, C, [(0, 2.5, 3.5, 3.2, 4.0), (5 * 10**18, -9.0, 1.0, 1.0, 2.0)])
    out = trace_decode.summarize([qkv, blank, head], n_embd=C)
    assert [(d["programs"], d["invalid"]) for d in out] == [(1, 1), (0, 1), (1, 1)]
    assert [d["role"] for d in out] == ["qkv", "attention", "lm_head"]
    assert out[0]["start_first"] == pytest.approx(0.0) and out[0]["end_last"] == pytest.approx(2.0)
    lines = trace_decode.report(out)
    assert lines[2].startswith("(3 programs left no valid record, in 3 launches")
    row = next(line for line in lines if line.startswith("lm_head"))
    assert row.split()[1:3] == ["1", "0.50"]  # timed from qkv's last written end


@pytest.mark.parametrize("stamp", sorted(trace_patches.STAMPS))
def test_stamps_move_the_second_stamp(stamp, tmp_path):
    """--stamp proj-q / attend / merge: the fused launch's second stamp replaces the weights' one
    (still one of each stamp), and the copy imports."""
    src = trace_patches.patched_source("decode_attention_proj", stamp)
    assert src.count("t1 = _now_after(") == 1 and src.count("t2 = _now()") == 1
    assert trace_patches.SUM_W not in src
    mod = trace_decode.load_traced("decode_attention_proj", tmp_path, stamp)
    assert "trace_ptr" in mod._decode_attention_proj_kernel.arg_names


def test_products_stamp_moves_the_slabs_second_stamp(tmp_path):
    """--stamp products: the whole-slab GEMV's second stamp moves from its wait to its products'
    end, before a group program's merge (one of each stamp still), and the copy imports; the
    other kernels keep their stamps."""
    src = trace_patches.patched_source("gemv_slab", "products")
    assert src.count("t1 = _now_after(") == 1 and src.count("t2 = _now()") == 1 and "t1 = t2" not in src
    assert src.index("t1 = _now_after(tl.sum(tl.sum(acc") < src.index("    finish = True\n")
    assert trace_patches.patched_source("gemv", "products") == trace_patches.patched_source("gemv")
    mod = trace_decode.load_traced("gemv_slab", tmp_path, "products")
    assert "trace_ptr" in mod._gemv_slab_kernel.arg_names


@pytest.mark.parametrize("stamp", sorted(trace_patches.ATTN_STAMPS))
def test_attention_stamps_move_its_second_stamp(stamp, tmp_path):
    """--stamp attn-q / attn-first / attn-loop: the separate decode attention's second stamp moves
    from its wait to the phase named (one of each stamp still, in order after the wait and before
    the output's store), and the copy imports; the fused launch keeps its own."""
    src = trace_patches.patched_source("decode_attention", stamp)
    assert src.count("t1 = _now_after(") == 1 and src.count("t2 = _now()") == 1 and "t1 = t2" not in src
    assert src.index("t2 = _now()") < src.index("t1 = _now_after(") < src.index("    o_ptrs = o_ptr + b")
    assert trace_patches.patched_source("decode_attention_proj", stamp) == \
        trace_patches.patched_source("decode_attention_proj")
    mod = trace_decode.load_traced("decode_attention", tmp_path, stamp)
    assert "trace_ptr" in mod._decode_attention_kernel.arg_names


def test_the_stand_in_compiles_for_the_register_fit(tmp_path, monkeypatch):
    """vocab_fma.fitted_programs sizes a persistent head by its compiled registers: the stand-in
    hands it the traced copy's kernel, compiled with an int64 record buffer."""
    fn = trace_decode.load_traced("vocab_screen", tmp_path)._vocab_screen_kernel
    seen = {}
    monkeypatch.setattr(fn, "warmup", lambda *a, **kw: seen.update(kw) or "compiled")
    traced = trace_decode._Traced(fn, "screen", ("N", "K"))
    assert traced.warmup(torch.zeros(2), 3, grid=(1,), K=768) == "compiled"
    assert seen["trace_ptr"].dtype == torch.int64 and seen["grid"] == (1,) and seen["K"] == 768
