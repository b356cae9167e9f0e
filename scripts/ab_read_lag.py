"""Same-call A/B of how far behind the device the host reads each step's ids (session 180).
Lag 0 reads a step's ids as it ends, so the device's queue runs dry while the host looks at them:
what streaming did before, one sync a step. The engine's READ_LAG reads them that many steps
behind, the next steps already queued. gpt2 random weights, prompt 32, greedy, CUDA graphs on;
the variants alternate, each reporting its median.
- decode tok/s at batch 1 and 8, 128 new tokens: generate with the eos id ignored (nothing read
  back; for scale), generate with an eos id the run never draws (every step read back, to the
  end), and stream, each read at lag 0 and at READ_LAG; and generate with a stop string the run
  never holds (at READ_LAG; each step read is searched, with the API's stop check and GPT-2's
  tokenizer from --tokenizer: what searching at every step, not every 16th, costs);
- a call ending at an eos id at step k (batch 1): its ms at READ_LAG, against the ms of the calls
  that run exactly k steps and ceil(k / 16) * 16 steps with the eos id ignored (the steps the
  engine ran before session 180, when it looked every 16 steps).

    python3 scripts/ab_read_lag.py --rounds 5
"""
import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.api import stop_checker  # noqa: E402
from minillm.bench import model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.decode_state import READ_LAG, StepReads  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402
from minillm.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEVER = "\x00a stop string random weights never write"

OLD_CHECK_EVERY = 16  # the engine's stop checks before session 180


def set_lag(engine, lag):
    """Every decode state of the engine reads lag steps behind from now on."""
    for st in engine._states.values():
        if st.reads is not None and st.reads.lag != lag:
            st.reads = StepReads(st.out, st.out_host, lag)


def with_eos(engine, eos):
    engine.model.config = dataclasses.replace(engine.model.config, eos_token_ids=tuple(eos))


def decode_tok_s(engine, prompts, params, stream, decode=None):
    """The call's decode tok/s; with decode, its rows searched for NEVER at each step read."""
    if stream:
        *_, (_, _, t) = engine.steps(prompts, params, stream=True)
    else:
        _, t = engine.generate(prompts, params, stop_check=decode and stop_checker(decode, [NEVER]))
    assert t["steps"] == params.max_new_tokens, "a run ended early: the variants compare full runs"
    return len(prompts) * (t["steps"] - 1) / t["decode_s"]


def alternate(variants, rounds):
    """{name: median} of the variants (name -> a call returning a number), alternated; round 0 is
    a warm-up (compilation, capture)."""
    got = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, call in variants.items():
            x = call()
            if r:
                got[name].append(x)
    return {name: statistics.median(xs) for name, xs in got.items()}, got


def first_fresh(ids, at_least):
    """The first step k >= at_least whose id did not come before it (None: no such step)."""
    return next((k for k in range(at_least, len(ids)) if ids[k] not in ids[:k]), None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the variants (default 5)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="GPT-2's tokenizer folder, for the stop-string variant (default: $MINILLM_TOKENIZER_DIR, "
                        "else .gpu_assets/gpt2-tokenizer; the variant is left out where neither has one)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {args.rounds}")
    # the stop-string variant's decode, from the folder given (loaded once, here), else found in main
    args.decode = None if args.tokenizer is None else stop_decode(args.tokenizer)
    if args.tokenizer is not None and args.decode is None:
        p.error(f"--tokenizer: expected a folder with tokenizer files, got {args.tokenizer}")
    return args


def stop_decode(folder):
    """The decode of the tokenizer for the stop-string variant, or None where there is none (said
    where the folder is the default one, looked for as --tokenizer's help says)."""
    given = folder is not None
    if not given:
        folder = Path(os.environ.get("MINILLM_TOKENIZER_DIR", ROOT / ".gpu_assets" / "gpt2-tokenizer"))
    tok = load_tokenizer(folder) if folder.is_dir() else None
    if tok is None:
        if not given:
            print(f"stop-string variant left out: no tokenizer at {folder} (--tokenizer)")
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def main(argv=None):
    args = parse_args(argv)
    require_cuda("ab_read_lag.py")
    decode = args.decode or stop_decode(None)
    cfg, weights = model_weights("gpt2", "cuda", torch.float16)
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True)
    free = SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True)
    watched = SamplingParams(max_new_tokens=128, temperature=0)
    print(f"READ_LAG {READ_LAG}; {args.rounds} rounds after a warm-up; medians")
    for batch in (1, 8):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, cfg.vocab_size - 1, (batch, 32), generator=g).tolist()
        drawn = {t for row in engine.generate(prompts, free)[0] for t in row}
        with_eos(engine, [next(t for t in range(cfg.vocab_size) if t not in drawn)])

        def run(params, stream, lag, decode=None):
            def call():
                set_lag(engine, lag)
                return decode_tok_s(engine, prompts, params, stream, decode)
            return call
        variants = {"generate, eos ignored": run(free, False, READ_LAG)}
        for lag in (0, READ_LAG):
            variants[f"generate, eos on, lag {lag}"] = run(watched, False, lag)
            variants[f"stream, lag {lag}"] = run(free, True, lag)
        if decode is not None:
            variants[f"generate, stop string, lag {READ_LAG}"] = run(free, False, READ_LAG, decode)
        medians, runs = alternate(variants, args.rounds)
        for name, m in medians.items():
            print(f"gpt2 batch {batch}: {name:<30} {m:10,.0f} tok/s "
                  f"(runs {', '.join(f'{x:,.0f}' for x in runs[name])})")
    prompt = torch.randint(0, cfg.vocab_size - 1, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    ids = engine.generate(prompt, free)[0][0]
    for k in sorted({first_fresh(ids, at_least) for at_least in (5, 20, 40, 90)} - {None}):
        steps = k + 1  # the eos id is the call's (k + 1)-th token
        old = -(-steps // OLD_CHECK_EVERY) * OLD_CHECK_EVERY

        def total_ms(params, eos):
            def call():
                with_eos(engine, eos)
                _, t = engine.generate(prompt, params)
                assert t["steps"] == params.max_new_tokens if params.ignore_eos else steps
                return 1e3 * t["total_s"]
            return call
        medians, _ = alternate({
            "ends at its eos id": total_ms(watched, [ids[k]]),
            f"{steps} steps, eos ignored": total_ms(dataclasses.replace(free, max_new_tokens=steps), []),
            f"{old} steps, eos ignored": total_ms(dataclasses.replace(free, max_new_tokens=old), []),
        }, args.rounds)
        print(f"gpt2 batch 1, eos at step {steps}: " + "; ".join(f"{n} {m:.3f} ms" for n, m in medians.items()))


if __name__ == "__main__":
    main()
