"""Same-call A/B of what a streamed step reads back (session 179): streaming with an
end-of-sequence id, the engine as it is (each step's ids only) against the same engine made to
read the device's eos flags back after every streamed step as well, as it did before
decode_state.HostRows. gpt2 random weights, batch 1 and 8, prompt 32, 128 new tokens, greedy,
CUDA graphs on; the variants alternate, and each reports its median decode tok/s. Also
minillm's generate (no per-step read) for scale.

    python3 scripts/ab_stream_reads.py --rounds 5
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.decode_state import HostRows  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

plain_done = HostRows.done


def done_reading_flags(self, st, n, vocab_size):
    """The old streamed check: the device's eos flags read back at every step."""
    if self.eos:
        st.finished[:len(self.ended)].tolist()
    return plain_done(self, st, n, vocab_size)


def decode_tok_s(engine, prompts, params, stream):
    if stream:
        *_, (_, _, t) = engine.steps(prompts, params, stream=True)
    else:
        _, t = engine.generate(prompts, params)
    return len(prompts) * (t["steps"] - 1) / t["decode_s"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the variants (default 5)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {args.rounds}")
    return args


def main(argv=None):
    args = parse_args(argv)
    require_cuda("ab_stream_reads.py")
    cfg, weights = model_weights("gpt2", "cuda", torch.float16)
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True)
    params = SamplingParams(max_new_tokens=128, temperature=0)  # eos on: the flags are checked
    for batch in (1, 8):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, cfg.vocab_size - 1, (batch, 32), generator=g).tolist()
        variants = {"generate": (plain_done, False), "stream (ids only)": (plain_done, True),
                    "stream (+ eos flags read)": (done_reading_flags, True)}
        got = {name: [] for name in variants}
        for r in range(args.rounds + 1):  # round 0: warm-up (compilation, capture)
            for name, (done, stream) in variants.items():
                HostRows.done = done
                rate = decode_tok_s(engine, prompts, params, stream)
                if r:
                    got[name].append(rate)
        HostRows.done = plain_done
        for name, rates in got.items():
            print(f"gpt2 batch {batch}: {name:<26} {statistics.median(rates):10,.0f} tok/s "
                  f"(runs {', '.join(f'{x:,.0f}' for x in rates)})")


if __name__ == "__main__":
    main()
