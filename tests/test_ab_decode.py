"""scripts/ab_decode.py: variants alternated in fresh processes, the table, the records, and a
clear one-line error for a bad variant (on the CPU, plain-torch backend, a tiny checkpoint)."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import build_checkpoint

pytestmark = pytest.mark.xdist_group("ab_decode")  # one worker: the module's fixtures run once

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ab_decode.py"
spec = importlib.util.spec_from_file_location("ab_decode", SCRIPT)
ab_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_decode)

CPU = ["--device", "cpu", "--dtype", "float32", "--backend", "torch", "--no-graphs", "--runs", "2",
       "--prompt-len", "5", "--new-tokens", "4", "--batch", "1", "2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    p = tmp_path_factory.mktemp("ab-ckpt")
    build_checkpoint(p, seed=3)
    return str(p)


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def greedy(ckpt, tmp_path_factory):
    """One greedy call of two variants (their records' folder and the finished process), which
    the sampled test also compares its ids with."""
    out = tmp_path_factory.mktemp("ab-greedy")
    return out, _run("--env", "MINILLM_GEMV_FIXED=0", "--env", "MINILLM_GEMV_FIXED=1,MINILLM_PDL=0", "--model", ckpt,
                     "--rounds", "1", "--out", str(out), *CPU)


def test_variants_alternate_and_the_table_compares_them(ckpt, greedy):
    tmp_path, done = greedy
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["variant"], r["batch"]) for r in rows] == [
        ("MINILLM_GEMV_FIXED=0", 1), ("MINILLM_GEMV_FIXED=0", 2),
        ("MINILLM_GEMV_FIXED=1,MINILLM_PDL=0", 1), ("MINILLM_GEMV_FIXED=1,MINILLM_PDL=0", 2)]
    assert all(r["tok_s"] > 0 and r["min"] <= r["tok_s"] <= r["max"] for r in rows)
    md = (tmp_path / "ab.md").read_text()
    table = [line for line in md.splitlines() if line.startswith(f"| {ckpt} |")]
    assert len(table) == 2 and all(line.endswith("| same |") for line in table)  # torch backend: no switch applies


def test_sampled_variants_draw_the_same_ids(ckpt, greedy, tmp_path):
    """--temperature samples from seed 0 in every process: the same switches give the same ids
    (the worker's draws do not depend on the variant's process), and the table says so."""
    done = _run("--env", "", "--env", "MINILLM_PDL=0", "--model", ckpt, "--rounds", "1", "--temperature", "30",
                "--top-k", "20", "--out", str(tmp_path), *CPU)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert len(rows) == 4 and rows[0]["ids"] == rows[2]["ids"] and rows[1]["ids"] == rows[3]["ids"]
    greedy_rows = json.loads((greedy[0] / "ab.json").read_text())
    assert greedy[1].returncode == 0 and greedy_rows[0]["batch"] == rows[0]["batch"] == 1
    # the test model's logits are peaked (50): a high temperature draws other ids
    assert greedy_rows[0]["ids"] != rows[0]["ids"]


def test_a_bad_variant_is_one_line():
    done = _run("--env", "MINILLM_GEMV_FIXED=2", "--env", "", "--model", "gpt2", "--rounds", "1", *CPU)
    assert done.returncode == 1
    assert done.stderr.strip() == ("ab_decode: variant MINILLM_GEMV_FIXED=2 failed (exit 1): ValueError: "
                                   "MINILLM_GEMV_FIXED: expected one of auto, 0, 1 (or unset), got '2'")


def test_a_bad_heap_recipe_is_one_line(ckpt):
    done = _run("--env", "AB_HEAP=nope", "--env", "", "--model", ckpt, "--rounds", "1", *CPU)
    assert done.returncode == 1
    assert done.stderr.strip() == ("ab_decode: variant AB_HEAP=nope failed (exit 1): ValueError: AB_HEAP: "
                                   "expected one of fresh, copy-test, arena, arena-2m (or unset), got 'nope'")


def test_heap_recipes_run_the_same_model(ckpt, tmp_path):
    """AB_HEAP lays the process's memory out otherwise (the copy test's buffers left cached, the
    weights moved into one arena): each variant runs, says which recipe it ran, and its ids are
    the fresh process's."""
    heaps = ("fresh", "copy-test", "arena-2m")
    done = _run(*[a for h in heaps for a in ("--env", f"AB_HEAP={h}")], "--model", ckpt, "--rounds", "1",
                "--batch", "2", "--out", str(tmp_path), *CPU[:-3])
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert [r["heap"] for r in rows] == list(heaps) and len({r["ids"] for r in rows}) == 1


def test_a_call_cut_short_keeps_the_rows_it_has(ckpt, tmp_path):
    """The records are written after every variant: the first variant's rows survive a later one
    that fails (as they would a device call's timeout)."""
    done = _run("--env", "", "--env", "MINILLM_GEMV_FIXED=2", "--model", ckpt, "--rounds", "1",
                "--out", str(tmp_path), *CPU)
    assert done.returncode == 1 and "variant MINILLM_GEMV_FIXED=2 failed" in done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["variant"], r["batch"]) for r in rows] == [("(as set)", 1), ("(as set)", 2)]
    md = (tmp_path / "ab.md").read_text()
    assert "| (as set) | MINILLM_GEMV_FIXED=2 |" in md and md.rstrip().endswith("|  | - | - |")


def test_a_tree_from_before_model_weights(ckpt, tmp_path):
    """A variant's PYTHONPATH may name a copy of an older tree, whose minillm.bench has no
    model_weights (before session 138): the worker takes build's weights there, the same ones,
    so both variants run and their ids match."""
    old = tmp_path / "old"
    for pkg in ("minillm", "kernels"):
        shutil.copytree(ROOT / pkg, old / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    bench = old / "minillm" / "bench.py"
    bench.write_text(bench.read_text().replace("model_weights(", "_weights_of_old_tree("))
    done = _run("--env", f"PYTHONPATH={ROOT}", "--env", f"PYTHONPATH={old}", "--model", ckpt, "--rounds", "1",
                "--out", str(tmp_path), *CPU)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "ab.json").read_text())
    assert [r["variant"] for r in rows] == [f"PYTHONPATH={ROOT}"] * 2 + [f"PYTHONPATH={old}"] * 2
    assert [r["ids"] for r in rows[:2]] == [r["ids"] for r in rows[2:]]


def test_a_value_may_hold_commas():
    """A comma starts a new pair only before NAME=: a list of widths stays one value."""
    assert ab_decode.variant("MINILLM_A=768,3072,MINILLM_B=1") == {"MINILLM_A": "768,3072", "MINILLM_B": "1"}
    assert ab_decode.variant("MINILLM_A=1,MINILLM_B=x,y") == {"MINILLM_A": "1", "MINILLM_B": "x,y"}
    assert ab_decode.variant("") == {}


@pytest.mark.parametrize("argv,message", [
    (["--env", "1", "--env", ""], "expected NAME=VALUE pairs"),
    (["--env", "minillm_a=1", "--env", ""], "expected NAME=VALUE pairs"),
    (["--env", "MINILLM_A=1,minillm_b=2", "--env", ""], "expected NAME=VALUE pairs"),
    (["--env", "MINILLM_A=1"], "expected two or more variants"),
    (["--env", "", "--env", "MINILLM_A=1", "--runs", "0"], "--runs: expected an integer >= 1"),
    (["--env", "MINILLM_A=1", "--env", "MINILLM_A=1"], "expected different variants"),
    (["--env", "", "--env", "MINILLM_A=1", "--temperature", "-1"], "--temperature / --top-k: expected numbers >= 0"),
    (["--env", "", "--env", "MINILLM_A=1", "--cold-timeout", "0"], "--timeout / --cold-timeout: expected seconds > 0"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        ab_decode.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_first_process_may_compile_cold(monkeypatch, capsys):
    """The call's first process gets --cold-timeout (it may compile every kernel), the rest
    --timeout; a process past its limit is one line naming the option."""
    timeouts = []

    def fake_run(cmd, env, capture_output, text, timeout):
        timeouts.append(timeout)
        row = {"model": "m", "batch": 1, "tok_s": 1.0, "min": 1.0, "max": 1.0, "ttft_ms": 1.0, "ids": "x",
               "cold_s": 0.0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(ab_decode.subprocess, "run", fake_run)
    ab_decode.main(["--env", "", "--env", "MINILLM_A=1", "--rounds", "2", "--timeout", "50"])
    assert timeouts == [600.0, 50.0, 50.0, 50.0]
    assert "| m | 1 | 1 / 1 | 1 / 1 | +0.0% | same |" in capsys.readouterr().out

    def slow_run(cmd, env, capture_output, text, timeout):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(ab_decode.subprocess, "run", slow_run)
    with pytest.raises(SystemExit, match=r"variant \(as set\) took more than --cold-timeout 700 s"):
        ab_decode.main(["--env", "", "--env", "MINILLM_A=1", "--cold-timeout", "700"])
    with pytest.raises(SystemExit, match=r"took more than --timeout 900 s"):  # a cold limit below --timeout
        ab_decode.main(["--env", "", "--env", "MINILLM_A=1", "--timeout", "900"])


def test_even_rounds_run_the_variants_in_reverse(monkeypatch, capsys):
    """Rounds alternate the order (A B C, C B A, A B C): no variant always runs first; the table
    keeps the variants in the order given, each one's rounds in round order."""
    order = []

    def fake_run(cmd, env, capture_output, text, timeout):
        order.append(env.get("MINILLM_A", "-"))
        rate = 100.0 + 10 * len(order)  # each process faster than the one before
        row = {"model": "m", "batch": 1, "tok_s": rate, "min": rate, "max": rate, "ttft_ms": 1.0, "ids": "x",
               "cold_s": 0.0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(ab_decode.subprocess, "run", fake_run)
    monkeypatch.delenv("MINILLM_A", raising=False)
    ab_decode.main(["--env", "", "--env", "MINILLM_A=1", "--env", "MINILLM_A=2", "--rounds", "3"])
    assert order == ["-", "1", "2", "2", "1", "-", "-", "1", "2"]
    # a steady drift over the call weighs on every variant alike over rounds 1 and 2 (270 each);
    # the odd third round tilts the means its way
    assert "| m | 1 | 110 / 160 / 170 | 120 / 150 / 180 | 130 / 140 / 190 | +2.3%, +4.5% | same |" in \
        capsys.readouterr().out


def test_the_ttft_metric_compares_times_to_first_token():
    rows = [{"model": "m", "batch": 1, "tok_s": 0.0, "ttft_ms": ms, "ids": "x", "variant": v, "round": r}
            for r, (a, b) in enumerate([(0.9, 0.85), (0.91, 0.87)], 1) for v, ms in (("A", a), ("B", b))]
    md = ab_decode.table(rows, ["A", "B"], metric="ttft")
    assert md.startswith("| model | batch (TTFT ms) | A | B |")
    assert "| m | 1 | 0.900 / 0.910 | 0.850 / 0.870 | -5.0% | same |" in md


def test_worker_options_drop_the_parents_own():
    argv = ["--env", "MINILLM_A=1", "--model", "gpt2", "--env=", "--out", "/tmp/x", "--batch", "1", "2"]
    assert ab_decode._without_option(ab_decode._without_option(argv, "--out"), "--env") == [
        "--model", "gpt2", "--batch", "1", "2"]
