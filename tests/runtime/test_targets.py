"""Same-run ratios and the decode targets (minillm/targets.py), from made-up benchmark rows."""
import pytest

from minillm import bench
from minillm.targets import TARGETS, check, ratios, report


def _row(engine, tok_s, model="gpt2", batch=1, prompt_len=32, new_tokens=128, dtype="float16", **extra):
    decodes = new_tokens > 1
    return {"engine": engine, "model": model, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "dtype": dtype, "tok_s": tok_s if decodes else None, "ttft_ms": extra.get("ttft_ms", 0.5),
            "prefill_tok_s": batch * prompt_len / (extra.get("ttft_ms", 0.5) * 1e-3),
            "step_ms": 1e3 * batch / tok_s if decodes else None,
            "floor_fraction": extra.get("floor", 0.45) if engine == "minillm" and decodes else None,
            "cold_s": 1.0, "device": "NVIDIA H100 80GB HBM3",
            **({"decoding": extra["decoding"]} if "decoding" in extra else {})}


def _by_name(results):
    return {t.name: (text, met) for t, text, met in results}


def test_ratios_pair_rows_of_the_same_setting_only():
    rows = [_row("minillm", 6000.0), _row("hf-eager", 150.0), _row("torch-compile", 2000.0),
            _row("hf-eager", 10.0, batch=8),  # another setting: no minillm row, no line
            _row("minillm", 30000.0, batch=8, dtype="bfloat16"), _row("hf-sdpa", 1000.0, batch=8),  # dtypes differ
            {"engine": "hf-sdpa", "model": "gpt2", "batch": 1, "error": "out of memory"}]
    lines = ratios(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    first = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert first["x hf-eager"] == "40.0x" and first["x torch-compile"] == "3.0x" and first["x hf-sdpa"] == "-"
    assert first["minillm tok/s"] == "6,000" and first["floor fraction"] == "0.45"
    second = dict(zip(header, (c.strip() for c in lines[3].strip("|").split("|"))))
    assert second["dtype"] == "bfloat16" and second["x hf-sdpa"] == "-"
    assert len(lines) == 4
    assert ratios([_row("hf-eager", 150.0)]) == ""


def test_ratios_of_minillm_alone_keep_their_columns():
    """`--engines minillm`: no peer columns, and each row has as many cells as the header."""
    lines = ratios([_row("minillm", 850.0, model="gpt2-xl", floor=0.636)]).splitlines()
    assert len(lines) == 3
    assert [line.count("|") for line in lines] == [8, 8, 8]
    assert lines[2] == "| gpt2-xl | 1 | 32 | 128 | float16 | 850 | 0.64 |"


def test_check_met_missed_and_not_run():
    rows = [_row("minillm", 6000.0, floor=0.51), _row("hf-eager", 150.0), _row("torch-compile", 2000.0),
            _row("minillm", 150000.0, batch=64), _row("hf-sdpa", 12000.0, batch=64),
            _row("minillm", None, prompt_len=1024, new_tokens=1, ttft_ms=1.44)]
    got = _by_name(check(rows))
    assert set(got) == {t.name for t in TARGETS}
    assert got["gpt2 batch 1 >= 40x transformers eager"] == ("40.00x (6,000 / 150 tok/s)", True)
    assert got["gpt2 batch 1 >= 4x torch-compile"][1] is False  # 3.0x
    assert got["gpt2 batch 1 floor fraction >= 0.5"] == ("0.510 (0.1667 ms a step)", True)
    assert got["gpt2 batch 64 >= 15x transformers sdpa"][1] is False  # 12.5x
    assert got["gpt2 batch 1 TTFT of a 1024-token prompt <= 2 ms"][1] is True
    for name in ("gpt2-xl batch 1 floor fraction >= 0.7", "gpt2 batch 64 >= 3x torch-compile"):
        assert got[name] == ("not in this run", None)


@pytest.mark.parametrize("floor,text", [(0.4954, "0.495"), (0.49979, "0.4998"), (0.499996, "0.499996")])
def test_a_near_miss_does_not_read_as_its_goal(floor, text):
    """A missed floor fraction and 3.996x torch-compile say so in their text, with more digits
    where three (two) would round up to the goal (the ratios table's two digits would show 0.50
    and 4.0x); six decimals at most."""
    rows = [_row("minillm", 7992.0, floor=floor), _row("torch-compile", 2000.0)]
    got = _by_name(check(rows))
    assert got["gpt2 batch 1 floor fraction >= 0.5"][0].startswith(text + " ") and \
        got["gpt2 batch 1 floor fraction >= 0.5"][1] is False
    assert got["gpt2 batch 1 >= 4x torch-compile"] == ("3.996x (7,992 / 2,000 tok/s)", False)
    slow = _by_name(check([_row("minillm", None, prompt_len=1024, new_tokens=1, ttft_ms=2.004)]))
    assert slow["gpt2 batch 1 TTFT of a 1024-token prompt <= 2 ms"][0].startswith("2.004 ms")


def test_check_ignores_other_settings():
    """A bfloat16 run or another prompt length measures none of the fp16 targets."""
    rows = [_row("minillm", 6000.0, dtype="bfloat16"), _row("hf-eager", 100.0, dtype="bfloat16"),
            _row("minillm", 6000.0, prompt_len=64), _row("hf-eager", 100.0, prompt_len=64)]
    assert all(met is None for _, _, met in check(rows))
    assert "Targets" not in report(rows) and "Same-run ratios" in report(rows)


def test_sampled_rows_measure_no_target_but_keep_their_ratios():
    """The targets are for greedy decoding; a sampled run still compares its engines, pairing
    rows of the same decoding only. Rows without "decoding" (older runs) are greedy."""
    sampled = "sampled (temperature 1, top_k 50, top_p 1)"
    rows = [_row("minillm", 5000.0, decoding=sampled), _row("hf-eager", 100.0, decoding=sampled),
            _row("torch-compile", 1000.0)]  # greedy: not this setting's peer
    assert all(met is None for _, _, met in check(rows))
    lines = ratios(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[header.index("x hf-eager")] == "50.0x" and cells[header.index("x torch-compile")] == "-"
    greedy = [_row("minillm", 6000.0, floor=0.51), _row("hf-eager", 150.0, decoding="greedy")]
    assert _by_name(check(greedy))["gpt2 batch 1 >= 40x transformers eager"][1] is True


def test_written_table_carries_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "device_slug", lambda: "test-gpu")
    monkeypatch.setattr(bench, "chart", lambda rows, path: False)
    bench.write([_row("minillm", 5000.0), _row("hf-eager", 100.0)], tmp_path)
    md = (tmp_path / "generate-test-gpu.md").read_text()
    assert "| gpt2 batch 1 >= 40x transformers eager | 50.00x (5,000 / 100 tok/s) | yes |" in md
    assert "not in this run" not in md  # only what the run measured
