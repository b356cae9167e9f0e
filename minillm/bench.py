"""Generation benchmark: minillm against transformers (eager, sdpa) and a torch.compile peer, in
one run on the same weights. Greedy by default, or sampled with the same settings in every
engine; EOS ignored, so every engine generates the same count.

Per (engine, model, batch): time to first token (prefill), decode tokens/s, the cold first run
(compilation / autotuning / graph capture) apart from the warm median of repeats, peak memory,
and for minillm the fraction of the memory-bandwidth floor (weight + KV bytes per decode step
over the device's copy bandwidth measured in the same run). On request, minillm-stream: minillm
reading every step's ids back as they come, as streaming does.
"""
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from .benchutil import copy_bandwidth, device_slug, environment
from .config import PRESETS
from .targets import report

ENGINES = ("minillm", "hf-eager", "hf-sdpa", "torch-compile")  # the default run
# minillm-stream: minillm reading each step's ids back as it goes (what stream() and a one-prompt
# `minillm generate` do), against minillm's generate, which reads back once
ALL_ENGINES = ("minillm", "minillm-stream", "hf-eager", "hf-sdpa", "torch-compile")
PROMPT_LEN, NEW_TOKENS = 32, 128  # the default run: prompt tokens, tokens generated per sequence


def _sync():
    torch.cuda.synchronize()


def build(model, device, dtype):
    """(config, transformers model, minillm weights dict) on the same tensors: a preset name gets
    random weights (speed does not depend on values), anything else loads as a checkpoint."""
    from transformers import GPT2LMHeadModel

    from .loader import resolve

    if model in PRESETS:
        return _random_preset(model, device, dtype)
    cfg, weights = model_weights(model, device, dtype)
    hf = GPT2LMHeadModel.from_pretrained(str(resolve(model)), dtype=dtype).to(device).eval()
    return cfg, hf, weights


def check_models(models, prompt_len, new_tokens):
    """Each model's config read before any GPU work: a name that is no preset and no checkpoint, or
    a prompt and new tokens past a model's context, fails here, not after the models before it."""
    from .loader import read_config, resolve

    for model in models:
        cfg = PRESETS[model] if model in PRESETS else read_config(resolve(model))
        if prompt_len + new_tokens - 1 > cfg.n_positions:  # the last new token is never fed back
            raise ValueError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens}: expected at most "
                             f"{cfg.n_positions + 1} for {model}'s context of {cfg.n_positions} positions")


def model_weights(model, device, dtype):
    """(config, minillm weights dict), for tools that run minillm alone: a checkpoint loads
    without importing transformers (seconds of a short process), a preset gets build's random
    weights, so the same as the benchmark's."""
    from .loader import load_weights, read_config, resolve

    if model in PRESETS:
        cfg, _, weights = _random_preset(model, device, dtype)
        return cfg, weights
    path = resolve(model)
    cfg = read_config(path)
    return cfg, load_weights(path, cfg, device, dtype)


def _random_preset(model, device, dtype):
    """A preset's transformers model from seed 0, and its weights as minillm names them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = PRESETS[model]
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**cfg.to_hf())).to(device=device, dtype=dtype).eval()
    weights = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()
               if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))}
    return cfg, hf, weights


def floor_seconds(cfg, batch, ctx, elt, copy_gbs):
    """Bytes one decode step must read at least: every weight once (wte doubles as the lm_head)
    plus each sequence's keys and values over `ctx` positions."""
    C = cfg.n_embd
    weight_bytes = (cfg.n_params - cfg.n_positions * C) * elt
    kv_bytes = 2 * cfg.n_layer * batch * ctx * C * elt
    return (weight_bytes + kv_bytes) / (copy_gbs * 1e9)


def _timed(fn, repeats):
    """Run fn() once cold, then `repeats` times; fn returns (ttft_s, decode_s)."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    cold = time.perf_counter() - t0
    runs = [fn() for _ in range(repeats)]
    return cold, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def decoding(sampling):
    """The rows' name for how tokens were picked: "greedy", or the sampling settings."""
    if not sampling:
        return "greedy"
    return "sampled (temperature {temperature:g}, top_k {top_k}, top_p {top_p:g})".format(**sampling)


def run_minillm(cfg, weights, ids, new, repeats, sampling=None, stream=False):
    from .generate import Engine
    from .model import GPT
    from .sampling import SamplingParams

    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, **(sampling or dict(temperature=0)))
    prompts = ids.tolist()

    def once():
        if stream:  # every step's ids read back as they come
            *_, (_, _, t) = engine.steps(prompts, params, stream=True)
        else:
            _, t = engine.generate(prompts, params)
        return t["ttft_s"], t["decode_s"]

    return _timed(once, repeats)


def run_hf(hf, impl, ids, new, repeats, sampling=None):
    hf.config._attn_implementation = impl
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=bool(sampling), pad_token_id=0, eos_token_id=None, **(sampling or {}))

    def once():
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, **kw)
        _sync()
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        _sync()
        total = time.perf_counter() - t1
        return t1 - t0, max(total - (t1 - t0), 1e-9)

    with torch.inference_mode():
        return _timed(once, repeats)


def new_peer(cfg, weights, ids, new, sampling=None):
    """The torch-compile peer for prompts ids (B, T) and `new` tokens, its cache as long as what
    runs (gpt-fast style). Compiled from a clean state, as in a process of its own: the graphs
    and guards earlier peers left on the same step function are dropped first."""
    from .torch_peer import TorchPeer

    torch._dynamo.reset()
    return TorchPeer(cfg, weights, ids.shape[0], max_len=ids.shape[1] + new, sampling=sampling)


def run_peer(cfg, weights, ids, new, repeats, sampling=None):
    peer = new_peer(cfg, weights, ids, new, sampling)

    def once():
        _sync()
        t0 = time.perf_counter()
        peer.start(ids)
        _sync()
        t1 = time.perf_counter()
        peer.decode(new - 1)
        _sync()
        return t1 - t0, time.perf_counter() - t1

    with torch.inference_mode():
        return _timed(once, repeats)


def bench(models=("gpt2",), batches=(1, 8, 64), prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, engines=ENGINES,
          repeats=3, dtype=torch.float16, sampling=None, log=print):
    """Run the matrix on the current CUDA device; returns the list of result rows. sampling:
    None (greedy) or dict(temperature=, top_k=, top_p=) for every engine, temperature > 0."""
    check_models(models, prompt_len, new_tokens)
    env = environment()
    bw = copy_bandwidth()
    log(f"{env['device']}: copy bandwidth {bw:.0f} GB/s (read + write); torch {env['torch']}, triton {env['triton']}; "
        f"{decoding(sampling)}")
    rows = []
    for model in models:
        cfg, hf, weights = build(model, "cuda", dtype)
        elt = torch.tensor([], dtype=dtype).element_size()
        for batch in batches:
            new = new_tokens
            ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda")
            for engine in engines:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    if engine in ("minillm", "minillm-stream"):
                        cold, ttft, dec = run_minillm(cfg, weights, ids, new, repeats, sampling,
                                                      stream=engine == "minillm-stream")
                    elif engine == "torch-compile":
                        cold, ttft, dec = run_peer(cfg, weights, ids, new, repeats, sampling)
                    else:
                        cold, ttft, dec = run_hf(hf, engine[3:], ids, new, repeats, sampling)
                except Exception as e:  # a peer that fails is reported, not fatal
                    log(f"{engine} {model} batch {batch}: failed: {type(e).__name__}: {str(e)[:200]}")
                    rows.append({"engine": engine, "model": model, "batch": batch, "error": str(e)[:500],
                                 "decoding": decoding(sampling), **env})
                    continue
                steps = max(new - 1, 1)
                step_s = dec / steps
                floor = floor_seconds(cfg, batch, prompt_len + new // 2, elt, bw)
                decodes = new > 1  # new_tokens 1 measures the prefill alone
                row = {"engine": engine, "model": model, "batch": batch, "prompt_len": prompt_len,
                       "new_tokens": new, "tok_s": batch * steps / dec if decodes else None,
                       "ttft_ms": ttft * 1e3, "prefill_tok_s": batch * prompt_len / ttft,
                       "step_ms": step_s * 1e3 if decodes else None, "floor_ms": floor * 1e3,
                       "floor_fraction": floor / step_s if decodes else None, "cold_s": cold,
                       "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "copy_gbs": bw,
                       "dtype": str(dtype).replace("torch.", ""), "decoding": decoding(sampling), **env}
                rows.append(row)
                log(_line(row))
        del hf, weights
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _line(r):
    return (f"{r['engine']:<14} {r['model']:<10} batch {r['batch']:<3} prompt {r['prompt_len']:<5} "
            f"{_fmt(r['tok_s'], '10,.0f')} tok/s  ttft {r['ttft_ms']:8.2f} ms  "
            f"prefill {r['prefill_tok_s']:11,.0f} tok/s  step {_fmt(r['step_ms'], '7.3f')} ms  "
            f"floor {_fmt(r['floor_fraction'], '.2f')}  cold {r['cold_s']:5.1f} s")


def _setting(rows, key, fmt, default=None):
    """One run setting for the chart's title: its value if every row shares it."""
    values = {r.get(key, default) for r in rows}
    return fmt(values.pop()) if len(values) == 1 else f"mixed {key}"


def chart(rows, path):
    """Decode tokens/s per (model, batch), engines side by side; returns False (no file) when
    no row decoded (a prefill-only run, new_tokens 1)."""
    ok = [r for r in rows if r.get("tok_s") is not None]
    if not ok:
        return False
    try:
        import matplotlib
    except ImportError:
        print("bench: matplotlib is not installed, no chart (pip install 'minillm[bench]')")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in ok}, key=lambda g: (g[0], g[1]))
    engines = [e for e in ALL_ENGINES if any(r["engine"] == e for r in ok)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(len(engines), 1)
    for j, e in enumerate(engines):
        vals = [next((r["tok_s"] for r in ok if (r["model"], r["batch"]) == g and r["engine"] == e), 0)
                for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=e)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (log)")
    setting = ", ".join([_setting(ok, "dtype", str), _setting(ok, "prompt_len", "prompt {}".format),
                         _setting(ok, "new_tokens", "{} new tokens".format)])
    mode = _setting(ok, "decoding", str, default="greedy")  # (rows of older runs have no "decoding": greedy)
    ax.set_title(f"{mode} decode, {setting} — {ok[0]['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def table(rows):
    lines = ["| engine | model | batch | prompt | decode tok/s | TTFT ms | prefill tok/s | ms/step | floor fraction |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['model']} | {r['batch']} | | failed | | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['model']} | {r['batch']} | {r['prompt_len']} | "
                     f"{_fmt(r['tok_s'], ',.0f')} | {r['ttft_ms']:.2f} | {r['prefill_tok_s']:,.0f} | "
                     f"{_fmt(r['step_ms'], '.3f')} | {_fmt(r['floor_fraction'], '.2f')} |")
    return "\n".join(lines)


def summary(rows):
    """How tokens were picked, the results table, then the same-run ratios and targets
    (minillm/targets.py: greedy rows only) if any."""
    extra = report(rows)
    head = f"Decoding: {_setting(rows, 'decoding', str, default='greedy')}.\n\n"
    return head + table(rows) + (f"\n\n{extra}" if extra else "")


def write(rows, out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    path = out / f"generate-{slug}.json"
    path.write_text(json.dumps(rows, indent=1))
    png = out / f"generate-{slug}.png"
    if not chart(rows, png) and png.exists():
        png.unlink()  # no decode rows: a chart left by an earlier run would describe other numbers
    (out / f"generate-{slug}.md").write_text(summary(rows) + "\n")
    return path
