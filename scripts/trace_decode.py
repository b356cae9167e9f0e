"""Per-program timeline of one replayed decode step (CUDA, Hopper): when every program of every
decode linear and decode-attention launch (fused into the projection or not) starts, passes
its dependent-launch wait, has its prefetched weights, ends, and on which SM. torch.profiler
sees whole kernels; this sees how a kernel's programs share the SMs with the next kernel's
early starters.

How: the seven decode kernel files (the CUDA-core vocabulary head's and the screened head's too)
are copied with four `%globaltimer` reads and a record store added (text patches at fixed
anchors in scripts/trace_patches.py, checked by tests/test_trace_decode.py), loaded as
`kernels._traced_*`, and the engine's launchers are pointed at them. The weights' arrival is
forced by a sum after the wait, so the trigger stays where the engine has it. The screened
lm_head's "weights" stamp is its stream's end instead (its best lower end known): from there to
its end are its atomic and its exact columns. The clock ticks in 0.256 us steps on an H100, and
instrumentation slows a step (gpt2-xl 2,084 against 1,736 us): read the timeline for its shape,
and time the step with --untraced.

    python3 scripts/trace_decode.py --model gpt2-xl --out bench/results/h100
    python3 scripts/trace_decode.py --model gpt2-xl --untraced --out /tmp/t   # step time only
    python3 scripts/trace_decode.py --model gpt2 --stamp proj-q --out /tmp/t  # the fused attention launch's q
    python3 scripts/trace_decode.py --model gpt2 --batch 64 --stamp products --out /tmp/t  # slabs' merges
    python3 scripts/trace_decode.py --model gpt2 --batch 64 --stamp attn-loop --out /tmp/t  # attention's phases

Records are filled with -1 before the replays; a row no program wrote is dropped and counted
in the report. From the tensor-core GEMV's weight descriptors (96b4762) to the fifty-third
session, its record call sat in the function after the kernel, so no GEMV launch wrote one
(gpt2 at batch 64, gpt2-xl at any batch). tests/test_trace_decode.py now checks that each
record call is inside its kernel.
"""
import argparse
import importlib.util
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from trace_patches import ATTN_STAMPS, FIELDS, MAX_SMS, SLAB_STAMPS, STAMPS, patched_source  # noqa: E402


def load_traced(name, tmp, stamp="weights"):
    """kernels/<name>.py with the timers in, as the module kernels._traced_<name> (Triton needs
    the source in a file)."""
    import kernels  # noqa: F401  (the package the copy's relative imports resolve in)

    path = Path(tmp) / f"_traced_{name}.py"
    path.write_text(patched_source(name, stamp))
    spec = importlib.util.spec_from_file_location(f"kernels._traced_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


RECORDS = []  # per launch in order: (kind, N, K, buffer, programs)


def _records(n, args):
    """An int64 record buffer of n words on the launch's device (its first tensor's: the CPU in
    compile-only runs)."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    return torch.empty(n, dtype=torch.int64, device=device)


class _Traced:
    """Stands in for a JIT kernel that launchers index with a grid: adds a record buffer, and
    notes the launch's shape (`names`: (N, K) of a linear, (H, D) of attention)."""

    def __init__(self, fn, kind, names):
        self.fn, self.kind, self.names = fn, kind, names
        self.__name__ = fn.__name__  # _tuning.launch names layouts by it

    def warmup(self, *args, **kw):
        """The traced copy compiled, for vocab_fma.fitted_programs: the persistent heads launch as
        many programs as the copy's registers (timers included) let the SMs hold at once, as the
        engine does for its own kernels (nothing runs: the record buffer only sets its dtype)."""
        return self.fn.warmup(*args, trace_ptr=_records(FIELDS, args), **kw)

    def shape(self, args, kw):
        """The named arguments' values, passed by keyword or by position."""
        return tuple(kw[n] if n in kw else args[self.fn.arg_names.index(n)] for n in self.names)

    def __getitem__(self, grid):
        def run(*args, **kw):
            n = grid[0] * (grid[1] if len(grid) > 1 else 1)
            buf = _records(n * FIELDS, args)
            RECORDS.append((self.kind, *self.shape(args, kw), buf, n))
            return self.fn[grid](*args, trace_ptr=buf, **kw)
        return run


def install(tmp, stamp="weights"):
    """Point the decode launchers at traced copies of their kernels (this process only)."""
    import kernels  # noqa: F401  (kernels.decode_attention there is the function; take the modules)
    from kernels._tuning import launch

    da, dap, gv, gs, gf, vf, vs = (sys.modules[f"kernels.{m}"] for m in (
        "decode_attention", "decode_attention_proj", "gemv", "gemv_slab", "gemv_fma", "vocab_fma", "vocab_screen"))
    traced_gemv = _Traced(load_traced("gemv", tmp)._gemv_kernel, "gemv", ("N", "K"))
    gv.launch = lambda kernel, grid, *a, **kw: launch(traced_gemv, grid, *a, **kw)
    traced_slab = _Traced(load_traced("gemv_slab", tmp, stamp)._gemv_slab_kernel, "gemv", ("N", "K"))
    gs.launch = lambda kernel, grid, *a, **kw: launch(traced_slab, grid, *a, **kw)
    proj = load_traced("decode_attention_proj", tmp, stamp)._decode_attention_proj_kernel
    traced_proj = _Traced(proj, "attn-proj", ("H", "D"))
    dap.launch = lambda kernel, grid, *a, **kw: launch(traced_proj, grid, *a, **kw)
    gf._gemv_fma_kernel = _Traced(load_traced("gemv_fma", tmp)._gemv_fma_kernel, "fma", ("N", "K"))
    vf._vocab_fma_kernel = _Traced(load_traced("vocab_fma", tmp)._vocab_fma_kernel, "vocab", ("N", "K"))
    vs._vocab_screen_kernel = _Traced(load_traced("vocab_screen", tmp)._vocab_screen_kernel, "screen", ("N", "K"))
    da._decode_attention_kernel = _Traced(load_traced("decode_attention", tmp, stamp)._decode_attention_kernel,
                                          "attn", ("H", "D"))


def summarize(launches, n_embd):
    """Per launch: times in us from the step's first program start, by program quantiles."""
    C = n_embd
    roles = {(3 * C, C): "qkv", (C, C): "attn-out", (4 * C, C): "fc", (C, 4 * C): "mlp-out"}
    # rows no program wrote keep the fill (-1), and a row with no SM id or its times out of order
    # is not a record either: dropped, and counted per launch
    recs = []
    for kind, N, K, buf, n in launches:
        r = buf.view(n, FIELDS).cpu()
        ok = (r[:, 0] >= 0) & (r[:, 0] < MAX_SMS) & (r[:, 1] > 0) & (r[:, 1] <= r[:, 3]) & (r[:, 3] <= r[:, 4])
        recs.append((kind, N, K, r[ok], int((~ok).sum())))
    t0 = min(int(r[:, 1].min()) for *_, r, _ in recs if r.shape[0])
    out = []
    for kind, N, K, r, invalid in recs:
        role = {"attn": "attention", "attn-proj": "attention+attn-out"}.get(kind) or roles.get((N, K), "lm_head")
        if not r.shape[0]:
            out.append(dict(role=role, programs=0, invalid=invalid))
            continue
        t = (r[:, 1:].double() - t0) / 1000.0  # (programs, 4): start, weights in, wait passed, end
        ev = sorted([(float(a), 1) for a in t[:, 0]] + [(float(b), -1) for b in t[:, 3]])
        alive = peak = 0
        for _, step in ev:
            alive += step
            peak = max(peak, alive)
        q = lambda col, f: float(t[:, col].quantile(f))  # noqa: E731
        out.append(dict(role=role, programs=r.shape[0], invalid=invalid,
                        sms=int(r[:, 0].unique().numel()), peak_alive=peak, start_first=q(0, 0), start_p70=q(0, 0.7),
                        start_last=q(0, 1), wait_first=q(2, 0), wait_last=q(2, 1), weights_med=q(1, 0.5),
                        weights_last=q(1, 1), end_med=q(3, 0.5), end_last=q(3, 1),
                        programs_raw=[[int(r[i, 0])] + [round(float(x), 3) for x in t[i]] for i in range(r.shape[0])]))
    return out


def report(launches):
    lines = ["per role, means over layers, us after the previous launch's last end:",
             f"{'role':10s} {'n':>3s} {'start':>7s} {'70% in':>7s} {'wait':>7s} {'weights':>8s} {'end':>7s}"]
    agg = defaultdict(list)
    timed = [d for d in launches if d["programs"]]  # launches with a valid record
    missing = sum(d["invalid"] for d in launches)
    if missing:
        where = [(i, d["role"], d["invalid"]) for i, d in enumerate(launches) if d["invalid"]]
        lines.append(f"({missing} programs left no valid record, in {len(where)} launches: those launches' ends "
                     f"are from the programs that did; (launch, role, programs): {where})")
    for prev, d in zip(timed, timed[1:]):
        e = prev["end_last"]
        agg[d["role"]].append([d["start_first"] - e, d["start_p70"] - e, d["wait_first"] - e,
                               d["weights_last"] - e, d["end_last"] - e])
    for role, v in agg.items():
        m = torch.tensor(v).mean(0).tolist()
        lines.append(f"{role:10s} {len(v):3d} " + " ".join(f"{x:7.2f}" for x in m))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl", help="a config preset (random weights); default gpt2-xl")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed for the step time")
    ap.add_argument("--untraced", action="store_true", help="the engine's own kernels: the step time alone")
    ap.add_argument("--stamp", choices=("weights", *STAMPS, *SLAB_STAMPS, *ATTN_STAMPS), default="weights",
                    help="the fused attention launch's second stamp: its weights' arrival (default), q and "
                         "the new row in (proj-q), its attention output computed (attend), or its "
                         "projection's partial, before the heads' merge (merge); or the whole-slab GEMV's: "
                         "its products done, before a group program's merge (products); or the separate "
                         "decode attention's: q and the new row in (attn-q), the tiles read before the wait "
                         "attended (attn-first), the loop over the later tiles done (attn-loop)")
    ap.add_argument("--out", required=True, help="folder for trace-<model>-b<batch>.json")
    args = ap.parse_args()
    from minillm.benchutil import require_cuda

    require_cuda("trace_decode")
    if not args.untraced:
        install(tempfile.mkdtemp(), args.stamp)
    from minillm.bench import NEW_TOKENS, PROMPT_LEN, model_weights
    from minillm.decode_state import cache_bucket
    from minillm.generate import Engine
    from minillm.model import GPT
    from minillm.sampling import SamplingParams

    cfg, weights = model_weights(args.model, "cuda", torch.float16)
    model = GPT(cfg, weights, "triton")
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    Engine(model).generate([[1] * 32] * args.batch, params)  # compile and tune outside the trace
    RECORDS.clear()
    # the benchmark's cache bucket (prompt 32 + 128 new tokens) at its mean context (32 + 64)
    bucket = cache_bucket(PROMPT_LEN + NEW_TOKENS, cfg.n_positions)
    st = Engine(model)._state(args.batch, params, max_len=bucket)  # two warm-up steps, then the capture
    captured = RECORDS[-len(RECORDS) // 3:] if RECORDS else []
    for *_, buf, _n in captured:  # a row the replays leave alone stays -1 (summarize drops it)
        buf.fill_(-1)
    st.pos.fill_(PROMPT_LEN + NEW_TOKENS // 2 - 1)  # the fed token's position: it attends over pos + 1
    for _ in range(5):
        st.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.replays):
        st.graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 1000 / args.replays
    res = dict(model=args.model, batch=args.batch, device=torch.cuda.get_device_name(), traced=not args.untraced,
               step_us=step_us, context=PROMPT_LEN + NEW_TOKENS // 2, cache_bucket=bucket,
               stamp=args.stamp, fields=["sm", "start", "weights in", "wait passed", "end"])
    print(f"{args.model} b{args.batch} {'untraced' if args.untraced else 'traced'}: {step_us:.1f} us a step")
    if captured:
        launches = summarize(captured, cfg.n_embd)
        print("\n".join(report(launches)))
        per_layer = (len(launches) - 1) // cfg.n_layer  # 5 launches, or 4 with attention fused; then the lm_head
        mid = per_layer * (cfg.n_layer // 2)  # keep every program of the middle two layers only
        for i, d in enumerate(launches):
            if not mid <= i < mid + 2 * per_layer:
                d.pop("programs_raw", None)
        res["launches"] = launches
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "-untraced" if args.untraced else "" if args.stamp == "weights" else f"-{args.stamp}"
    path = out / f"trace-{args.model}-b{args.batch}{tag}.json"
    path.write_text(json.dumps(res))
    print("wrote", path)


if __name__ == "__main__":
    main()
