"""Probe: does gpt2 batch 64's decode speed follow where and how its KV cache lies in memory?

Session 121 saw gpt2 batch 64's processes settle at two levels about 1.8% apart, each steady
within its process, and engines built side by side in one process do the same
(bench/results/h200/session-121/, calls 4-5). A step reads only the first ~100 positions of each
(row, head)'s 1,024, runs 128 KB apart, so where those runs fall may decide the level. This
builds --engines engines (each GPT holds its own weight copies) and, for each, --copies caches of
every layout in --layouts and pad in --pads (KVCache's layout and pad; "positions" keeps a short
context's positions in one dense block), all kept alive so none reuses another's memory. Every
(engine, layout, pad, copy) is timed in turn, the order reversed every other round: its cache is
installed (the decode state and graphs captured anew, one untimed run), then --runs timed runs.
If copies of one kind sit at different levels, steadily, the level follows the cache's
placement; if a layout or pad lifts every copy to the upper level, it is the change to time end
to end. Session 122 found the level follows the engine, not its caches; --share-weights builds
every engine on one GPT (one set of weights; own caches, decode states, graphs) to tell whether
it is the weights' placement or the rest of an engine's. Engines on one model did not split
(session 122, call 2); --arena then copies each engine's weights into one allocation, in the
order a step reads them, to see whether that lands every engine at the upper level. It did not:
the first arena allocated sat low in three processes of three (calls 4-5). --arena-order reverse
allocates the last engine's first, and --spacer-mb N puts an unused allocation of N MB before
each: if the low engine moves with them, it follows the allocation, not the engine. It did not
(session 123, call 2): engine 0 sat low in every order, with or without the spacer. --decoys N
builds N models (their own weights, kept alive, never timed) before the timed engines, and
--run-decoys also runs each once (the process's first compile and first graphs): does the low
level go with the first model built, or the first engine run, or stay with engine 0? It did none
of these (call 3): the low engines changed, and one engine moved between levels from one round to
the next, so the level is set when a turn captures its graphs. Each turn therefore records where
its new graphs' memory pools lie (their activations) and its decode state's address;
--engines 1 --rounds 24 recaptures one engine 24 times. A lone engine sat at the upper level on
every capture, its pools at the same addresses each time (calls 4-5: 54 captures, two hosts): the
lower level needs several models in the process, so no placement rule lifts a user's engine.

    python3 scripts/probe_cache_placement.py --layouts heads positions --pads 0 8 --copies 2 --out /tmp/probe
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import decode_plan as plan  # noqa: E402
from minillm.bench import model_weights  # noqa: E402
from minillm.decode_state import batch_bucket  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT, KVCache  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

TWO_MB = 2 << 20  # the GPU's large page


def schedule(engines, kinds, copies, rounds):
    """[(round, engine, kind, copy)]: every cache once a round, the order reversed on odd rounds."""
    one = [(e, k, c) for e in range(engines) for k in kinds for c in range(copies)]
    return [(r, *key) for r in range(rounds) for key in (one if r % 2 == 0 else one[::-1])]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="example:\n" + __doc__.split("\n\n")[-1] + "\n",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="a preset (random weights) or a checkpoint folder (default gpt2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layouts", nargs="+", default=[plan.CACHE_LAYOUT], choices=KVCache.LAYOUTS,
                   help=f"cache layouts (default {plan.CACHE_LAYOUT}, the engine's)")
    p.add_argument("--pads", type=int, nargs="+", default=[0], help="cache pads in positions (default 0)")
    p.add_argument("--copies", type=int, default=2, help="caches of each layout and pad an engine (default 2)")
    p.add_argument("--engines", type=int, default=2, help="engines built side by side (default 2)")
    p.add_argument("--share-weights", action="store_true",
                   help="every engine on one model (one set of weights) instead of each its own")
    p.add_argument("--arena", action="store_true",
                   help="each model's weights copied into one allocation, in the order a step reads them")
    p.add_argument("--arena-order", choices=["built", "reverse"], default="built",
                   help="with --arena: allocate the arenas in the engines' order or the reverse (default built)")
    p.add_argument("--spacer-mb", type=int, default=0,
                   help="with --arena: an unused allocation of this many MB before each arena (default 0)")
    p.add_argument("--decoys", type=int, default=0,
                   help="models built (own weights, kept, never timed) before the timed engines (default 0)")
    p.add_argument("--run-decoys", action="store_true", help="with --decoys: run each decoy once before the engines")
    p.add_argument("--rounds", type=int, default=2, help="times every cache is timed (default 2)")
    p.add_argument("--runs", type=int, default=3, help="timed runs a turn, their median kept (default 3)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, help="folder for probe-cache-placement.json")
    args = p.parse_args(argv)
    for name in ("batch", "copies", "engines", "rounds", "runs", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if (args.arena_order != "built" or args.spacer_mb) and not args.arena:
        p.error("--arena-order, --spacer-mb: expected with --arena")
    if args.decoys < 0:
        p.error(f"--decoys: expected a count >= 0, got {args.decoys}")
    if args.run_decoys and not args.decoys:
        p.error("--run-decoys: expected with --decoys N > 0")
    if args.spacer_mb < 0:
        p.error(f"--spacer-mb: expected MB >= 0, got {args.spacer_mb}")
    if args.arena and args.share_weights:
        p.error("--arena: expected engines with their own weights, not --share-weights")
    if min(args.pads) < 0:
        p.error(f"--pads: expected cache positions >= 0, got {min(args.pads)}")
    return args


ARENA_ALIGN = 256  # bytes: every weight starts on a 256-byte boundary (TMA asks 16)


def arena(model, align=ARENA_ALIGN):
    """Copy the model's weights (embeddings, each block's linears, the head) into one uint8
    allocation, in the order a decode step reads them, each starting on an `align`-byte boundary,
    and point the model at the copies (same values, same strides). Returns the allocation."""
    blocks = [(blk, name) for blk in model.blocks for name in ("attn", "attn_proj", "fc", "mlp_proj")]
    groups = [[model.wte], [model.wpe]] + [list(getattr(b, n)) for b, n in blocks] + [list(model.lm_head)]
    tensors = [t for g in groups for t in g if t is not None]
    if not all(t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous()) for t in tensors):
        raise ValueError("arena: expected dense weights (contiguous, or 2-D out-major)")
    sizes = [-(-t.numel() * t.element_size() // align) * align for t in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=model.device)
    moved, off = {}, 0
    for t, n in zip(tensors, sizes):
        flat = buf[off:off + t.numel() * t.element_size()].view(t.dtype)
        moved[id(t)] = flat.as_strided(t.shape, t.stride(), flat.storage_offset()).copy_(t)
        off += n

    def new(group):
        return tuple(None if t is None else moved[id(t)] for t in group)
    model.wte, model.wpe = moved[id(model.wte)], moved[id(model.wpe)]
    for blk, name in blocks:
        setattr(blk, name, new(getattr(blk, name)))
    model.lm_head = new(model.lm_head)
    return buf


def graph_segments():
    """{pool id: [(address, size, kind, [(offset, size) of each allocated block])]} of every
    memory pool but the general one: the captured graphs' (their activations, the step's
    intermediate tensors)."""
    pools = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg["segment_pool_id"])
        if pool != (0, 0):
            blocks = [(b["address"] - seg["address"], b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"]
            pools.setdefault(str(pool), []).append((hex(seg["address"]), seg["total_size"], seg["segment_type"], blocks))
    return pools


def install(engine, cache):
    """Make `cache` the engine's for its batch: its decode states and prefill graphs (which hold
    the old cache's addresses) are dropped, to be captured anew on the next call."""
    engine._caches[cache.batch] = cache
    engine._states.clear()
    engine._prefill_graphs.clear()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_cache_placement.py: needs a CUDA GPU")
    cfg, weights = model_weights(args.model, "cuda", torch.float16)
    B = args.batch
    g = torch.Generator().manual_seed(B)  # ab_decode.py's prompts
    prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0)
    decoys = [Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True) for _ in range(args.decoys)]
    for d in decoys if args.run_decoys else ():
        d.generate(prompts, params)
    shared = GPT(cfg, weights, "triton") if args.share_weights else None
    engines = [Engine(shared or GPT(cfg, weights, "triton"), use_cuda_graphs=True) for _ in range(args.engines)]
    arenas, spacers = {}, []  # engine -> its arena; the unused allocations, kept alive
    order = range(args.engines) if args.arena_order == "built" else range(args.engines - 1, -1, -1)
    for e in order if args.arena else ():
        spacers.append(torch.empty(args.spacer_mb << 20, dtype=torch.uint8, device="cuda"))
        arenas[e] = arena(engines[e].model)
    kinds = [(layout, pad) for layout in args.layouts for pad in args.pads]
    rows_run = batch_bucket(B)  # the batch the engine's graphs run (and its cache holds)
    caches = {(e, k, c): engines[e].model.new_cache(rows_run, pad=k[1], layout=k[0])
              for e in range(args.engines) for k in kinds for c in range(args.copies)}
    rates, turns = {key: [] for key in caches}, []
    for r, e, k, c in schedule(args.engines, kinds, args.copies, args.rounds):
        install(engines[e], caches[e, k, c])
        before = graph_segments()
        engines[e].generate(prompts, params)  # capture (and, the first time, compile)
        new_pools = {pool: segs for pool, segs in graph_segments().items() if pool not in before}
        states = [hex(st.tokens.data_ptr()) for st in engines[e]._states.values()]
        if engines[e]._caches != {rows_run: caches[e, k, c]}:
            sys.exit(f"probe_cache_placement.py: engine {e} ran another cache than the one installed")
        runs = []
        for _ in range(args.runs):
            _, t = engines[e].generate(prompts, params)
            runs.append(B * (t["steps"] - 1) / t["decode_s"])
        rates[e, k, c].append(round(statistics.median(runs)))
        # where this turn's captured graphs keep the step's intermediates, and its decode state
        turns.append({"round": r, "engine": e, "layout": k[0], "pad": k[1], "copy": c, "tok_s": rates[e, k, c][-1],
                      "graph_pools": new_pools, "state_tokens": states})
    rows = [{"engine": e, "layout": k[0], "pad": k[1], "copy": c, "tok_s": rates[e, k, c],
             "k_addr": hex(caches[e, k, c].k.data_ptr()), "k_in_2mb": caches[e, k, c].k.data_ptr() % TWO_MB,
             "v_in_2mb": caches[e, k, c].v.data_ptr() % TWO_MB,
             "head_addr": hex(engines[e].model.lm_head[0].data_ptr()),
             "arena_addr": hex(arenas[e].data_ptr()) if arenas else None,
             "arena_rank": list(arenas).index(e) if arenas else None} for e, k, c in caches]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "batch": B, "device": torch.cuda.get_device_name(), "argv": sys.argv[1:],
                "share_weights": args.share_weights, "arena": args.arena, "arena_order": args.arena_order,
                "spacer_mb": args.spacer_mb, "decoys": args.decoys, "run_decoys": args.run_decoys}
        (args.out / "probe-cache-placement.json").write_text(json.dumps({**meta, "rows": rows, "turns": turns}, indent=1))


if __name__ == "__main__":
    main()
