"""The benchmark's report (table columns, a chart only for what was measured; no GPU needed) and,
on a GPU, its torch-compile peer; the environment each record names."""
import pytest
import torch

from minillm.bench import chart, table
from tests.models import build_checkpoint


def _row(engine="minillm", batch=1, prompt_len=32, new_tokens=128, tok_s=4000.0, dtype="float16"):
    decodes = new_tokens > 1
    return {"engine": engine, "model": "gpt2", "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "tok_s": tok_s if decodes else None, "ttft_ms": 1.25, "prefill_tok_s": batch * prompt_len / 1.25e-3,
            "step_ms": 0.25 if decodes else None, "floor_fraction": 0.24 if decodes else None, "dtype": dtype,
            "device": "NVIDIA H200", "cold_s": 1.0}


def test_table_reports_prefill_tokens_per_second():
    lines = table([_row(prompt_len=1024, new_tokens=1), {"engine": "hf-eager", "model": "gpt2", "batch": 1,
                                                          "error": "out of memory"}]).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert "prefill tok/s" in header
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[header.index("prefill tok/s")] == "819,200"  # 1024 tokens in 1.25 ms
    assert cells[header.index("decode tok/s")] == "-"
    failed = [c.strip() for c in lines[3].strip("|").split("|")]
    assert len(failed) == len(header) and "failed" in failed


def test_no_chart_without_decode_rows(tmp_path):
    path = tmp_path / "c.png"
    assert chart([_row(prompt_len=1024, new_tokens=1)], path) is False
    assert not path.exists()


def test_chart_title_names_the_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, text, *a, **k: titles.append(text))
    path = tmp_path / "c.png"
    assert chart([_row(dtype="bfloat16", prompt_len=64, new_tokens=16), _row(engine="hf-sdpa", tok_s=150.0,
                                                                          dtype="bfloat16", prompt_len=64,
                                                                          new_tokens=16)], path)
    assert path.stat().st_size > 0
    assert "bfloat16" in titles[0] and "prompt 64" in titles[0] and "16 new tokens" in titles[0]
    assert chart([_row(prompt_len=32), _row(batch=8, prompt_len=64)], path)
    assert "mixed prompt_len" in titles[1]
    assert titles[0].startswith("greedy decode")  # rows of older runs, without "decoding"
    sampled = "sampled (temperature 0.8, top_k 50, top_p 0.95)"
    assert chart([_row() | {"decoding": sampled}], path)
    assert titles[2].startswith(sampled + " decode")


def test_chart_shows_a_streaming_row_beside_minillms(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels = []
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, *a, label=None, **k: labels.append(label))
    rows = [_row(engine="hf-sdpa", tok_s=150.0), _row(engine="minillm-stream", tok_s=3600.0), _row()]
    assert chart(rows, tmp_path / "c.png")
    assert labels == ["minillm", "minillm-stream", "hf-sdpa"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA graphs: GPU only")
def test_streaming_rows_decode(tmp_path):
    """minillm-stream times the engine reading every step back (the rows a --engines
    minillm-stream run adds) beside minillm's generate, on the same weights."""
    from minillm.bench import bench

    build_checkpoint(tmp_path / "m", n_layer=2, n_head=4, n_embd=64, vocab_size=500)
    rows = bench(models=[str(tmp_path / "m")], batches=(1, 3), prompt_len=7, new_tokens=12,
                 engines=("minillm", "minillm-stream"), repeats=1, dtype=torch.float32, log=lambda *a: None)
    assert [(r["engine"], r["batch"]) for r in rows] == [("minillm", 1), ("minillm-stream", 1), ("minillm", 3),
                                                         ("minillm-stream", 3)]
    assert all(r["tok_s"] > 0 and "error" not in r for r in rows)


def test_environment_names_the_gpu(monkeypatch):
    from types import SimpleNamespace

    from minillm.benchutil import environment

    assert ("gpu_uuid" in environment()) == torch.cuda.is_available()
    uuid = "d5fdbc55-0d66-ab9d-d328-f33cac94f7e0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuid))
    env = environment()
    assert env["device"] == "NVIDIA H200" and env["gpu_uuid"] == uuid  # runs on one GPU are told apart
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace())
    assert environment()["gpu_uuid"] == "unknown"  # a torch without the field still records the run


def test_summary_names_the_decoding():
    from minillm.bench import decoding, summary

    assert decoding(None) == "greedy"
    mode = decoding(dict(temperature=0.8, top_k=50, top_p=0.95))
    assert mode == "sampled (temperature 0.8, top_k 50, top_p 0.95)"
    assert summary([_row() | {"decoding": mode}]).startswith(f"Decoding: {mode}.")
    assert summary([_row()]).startswith("Decoding: greedy.")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the torch.compile peer runs CUDA graphs: GPU only")
@pytest.mark.parametrize("tie,sampling", [(True, None), (False, None),
                                          (True, dict(temperature=0.9, top_k=20, top_p=0.9)),
                                          (False, dict(temperature=1.0, top_k=50, top_p=1.0))])
def test_torch_compile_peer_matches_transformers(tie, sampling, tmp_path):
    """The benchmark's torch-compile peer does the work it is timed on: its ids equal
    transformers' (peaked fp32 test model, tied or own lm_head), greedy and sampled from the same
    seed, for two batch sizes compiled one after the other in one process, as the benchmark runs
    them."""
    from minillm.bench import build, new_peer

    build_checkpoint(tmp_path / "m", n_layer=2, n_head=4, n_embd=64, vocab_size=500, tie=tie)
    cfg, hf, weights = build(str(tmp_path / "m"), "cuda", torch.float32)
    torch.manual_seed(1)
    for batch in (1, 3):
        ids = torch.randint(0, cfg.vocab_size, (batch, 7), device="cuda")
        torch.manual_seed(2)
        expect = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                             do_sample=bool(sampling), pad_token_id=0, eos_token_id=None, **(sampling or {}))[:, 7:]
        torch.manual_seed(2)
        with torch.inference_mode():
            out = new_peer(cfg, weights, ids, 12, sampling).generate(ids, 12)
        assert torch.equal(out, expect), f"batch {batch}"


def test_model_weights_load_a_checkpoint_without_transformers(tmp_path):
    """model_weights (the tools that run minillm alone) gives build's config and weights, and for
    a checkpoint never imports transformers: seconds saved in every short process."""
    import subprocess
    import sys

    from minillm.bench import build, model_weights

    build_checkpoint(tmp_path / "m", n_layer=2, n_head=4, n_embd=64, vocab_size=500, tie=False)
    cfg, hf, expect = build(str(tmp_path / "m"), "cpu", torch.float32)
    got_cfg, got = model_weights(str(tmp_path / "m"), "cpu", torch.float32)
    assert got_cfg == cfg and got.keys() == expect.keys()
    assert all(torch.equal(got[k], expect[k]) for k in expect)
    probe = ("import sys, torch; from minillm.bench import model_weights; "
             f"cfg, w = model_weights({str(tmp_path / 'm')!r}, 'cpu', torch.float32); "
             "print(len(w), 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == [str(len(expect)), "False"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a device-to-device copy: GPU only")
def test_copy_bandwidth_hands_its_buffers_back():
    """The copy test's 2 GiB must not stay in torch's cache, where the benchmark's model would be
    allocated inside it (a layout that decodes slower than a user's process)."""
    from minillm.benchutil import copy_bandwidth

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    gbs = copy_bandwidth(nbytes=1 << 28)
    assert gbs > 0
    assert torch.cuda.memory_reserved() - before < 1 << 26, "the copy test's buffers stayed cached"
