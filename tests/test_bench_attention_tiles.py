"""scripts/bench_attention_tiles.py: its candidate lists and summary on made-up rows (no GPU), and
its refusal where there is no GPU."""
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_attention_tiles", ROOT / "scripts" / "bench_attention_tiles.py")
tiles = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiles)


def _row(shape, config, us=None, same=True, dtype="float16"):
    if us is None:
        return dict(dtype=dtype, shape=shape, config=config, error="OutOfResources: shared memory")
    return dict(dtype=dtype, shape=shape, config=config, same_bits=same, max_diff=0.0 if same else 1e-3, us=us)


def test_the_sweep_starts_with_the_tuners_list_and_repeats_no_layout():
    listed, sweep = tiles.configs(False), tiles.configs(True)
    assert sweep[:len(listed)] == listed
    assert len({tiles.name(c) for c in sweep}) == len(sweep) >= 24
    assert {c["BLOCK_N"] for c in sweep} >= {32, 64, 128}


def test_summary_names_the_fastest_the_fastest_with_the_first_bits_and_the_others():
    a, b = [1, 12, 32, 64, 0], [3, 20, 300, 64, 111]
    rows = [_row(a, "64x64 w4 s3", 3.0), _row(a, "64x32 w4 s3", 2.5, same=False), _row(a, "128x64 w8 s3", 3.2),
            _row(a, "128x128 w8 s4"), _row(b, "64x64 w4 s3"), _row(b, "128x64 w8 s3")]
    lines = tiles.summary(rows).splitlines()
    assert lines[2] == "| float16 | 1x12x32x64 (0) | 64x32 w4 s3 | 2.50 | 64x64 w4 s3 | 3.00 | 64x32 w4 s3 |"
    assert lines[3] == "| float16 | 3x20x300x64 (111) | every layout failed | | | | |"
    assert len(lines) == 4


@pytest.mark.skipif(ON_GPU, reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        tiles.main(["--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "a CUDA GPU is needed" in capsys.readouterr().err
