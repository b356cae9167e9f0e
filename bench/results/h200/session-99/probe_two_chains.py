"""Probe (ninety-ninth session): does gpt2 batch 64's step run faster as two 32-row steps on two
streams at once? Every kernel of the 64-row step is latency-bound (4-7 us a launch for 0.3-1.1 us
of weight bytes), so two independent 32-row chains might overlap where one 64-row chain idles.

Three engines share one model: one of 64 rows, two of 32 (each its own cache and decode state).
Each captures its decode step (graph) as the engine does; then, from the benchmark's mid context
(position 96), CUDA events time N replays of: the 64-row graph; one 32-row graph; the two 32-row
graphs one after the other on one stream; and the two on two streams at once.

The two 32-row chains share the per-device arrival counters (kernels/_workspace.py), which are
made for launches that never run at once: run concurrently, their split reductions may add the
wrong partials, so the two-stream ids are not checked here; only the time is of use (no kernel
spins on a counter, so nothing can hang). An engine change would need a counter buffer a chain.
Run: PYTHONPATH=. python3 bench/results/h200/session-99/probe_two_chains.py [--steps 100]
"""
import argparse
import json

import torch

from minillm.bench import build
from minillm.generate import Engine
from minillm.model import GPT
from minillm.sampling import SamplingParams


def state(model, B):
    engine = Engine(model)
    engine.generate([[1] * 32] * B, SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True))  # the benchmark's cache bucket (256)
    (st,) = engine._states.values()
    st.engine = engine  # the engine holds the KV cache its graph reads: keep it alive
    return st


def timed(fn, states, steps, start_pos):
    for st in states:
        st.pos.fill_(start_pos - 1)
        st.step.zero_()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / steps  # us a step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg, hf, weights = build("gpt2", "cuda", torch.float16)
    del hf
    model = GPT(cfg, weights, "triton")
    s64, sa, sb = state(model, 64), state(model, 32), state(model, 32)
    main_stream, s1, s2 = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams():
        s1.wait_stream(main_stream)
        s2.wait_stream(main_stream)
        with torch.cuda.stream(s1):
            sa.graph.replay()
        with torch.cuda.stream(s2):
            sb.graph.replay()
        main_stream.wait_stream(s1)
        main_stream.wait_stream(s2)

    def one_stream():
        sa.graph.replay()
        sb.graph.replay()

    ways = {"b64": (s64.graph.replay, [s64]), "b32": (sa.graph.replay, [sa]),
            "2 x b32, one stream": (one_stream, [sa, sb]), "2 x b32, two streams": (two_streams, [sa, sb])}
    res = {k: [] for k in ways}
    start = 96 - args.steps // 2
    for r in range(args.rounds):
        for name, (fn, states) in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            timed(fn, states, 10, start)  # warm
            res[name].append(timed(fn, states, args.steps, start))
    for name, us in res.items():
        rows = 32 if name == "b32" else 64
        best = min(us)
        print(f"{name:22s} {', '.join(f'{u:7.1f}' for u in us)} us a step   best {best:7.1f}   "
              f"{rows * 1e6 / best:10,.0f} tok/s")
    print(json.dumps({"device": torch.cuda.get_device_name(), "steps": args.steps, "us": res}))


if __name__ == "__main__":
    main()
