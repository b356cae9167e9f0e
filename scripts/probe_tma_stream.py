"""Probe: how fast can persistent programs stream weights through a TMA ring in shared memory?

scripts/probe_stream_step.py's ring alone (no arithmetic, no waits) read gpt2-xl's weights at
about 2.2 TB/s on an H200, half the copy rate, whatever the weights' layout and the tile's rows.
Here each program streams its own contiguous share of one large buffer, box after box, through a
ring of STAGES slots (one mbarrier each) and sums what arrives (so the reads are used), for
several box shapes, shared-memory swizzles, ring depths and programs an SM.

Outcome on an H200 (bench/results/h200/session-105/, call 5): 4.62-4.70 TB/s in every shape,
1.09-1.11x the copy rate (which counts a read and a write). The ring is not what was slow.

    python3 scripts/probe_tma_stream.py --out DIR      # H100 / H200
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.cli import _int_at_least, _number  # noqa: E402
from stream_step_kernels import _barrier, _tma_load  # noqa: E402  (their names in Triton 3.6 and the newest)


@gluon.jit
def _tma_stream_kernel(desc, out_ptr, boxes, STAGES: gl.constexpr, BOX_R: gl.constexpr, BOX_C: gl.constexpr,
                       TOUCH: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BOX_C, BOX_C // 8], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BOX_R, BOX_C], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    first = pid * boxes
    for s in gl.static_range(STAGES):
        mbarrier.expect(bars.index(s), desc.block_type.nbytes)
        _tma_load(desc, [(first + s) * BOX_R, 0], bars.index(s), ring.index(s))
    acc = gl.zeros([BOX_R, BOX_C], gl.float32, blk)
    for j in range(boxes):
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        if TOUCH:
            acc += ring.index(slot).load(blk).to(gl.float32)
        _barrier()
        fence_async_shared()
        if j + STAGES < boxes:
            mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
            _tma_load(desc, [(first + j + STAGES) * BOX_R, 0], bars.index(slot), ring.index(slot))
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


# (box rows, box columns, swizzle bytes, ring slots, programs an SM)
CONFIGS = [(64, 256, 0, 6, 1), (256, 64, 128, 6, 1), (128, 64, 128, 12, 1), (64, 64, 128, 24, 1),
           (64, 256, 0, 3, 2), (128, 64, 128, 6, 2), (64, 64, 128, 6, 4), (32, 256, 0, 12, 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gbytes", type=_number(0, 64, lo_open=True), default=3.0,
                    help="buffer size in GB, at most 64 (default 3.0, gpt2-xl's weights)")
    ap.add_argument("--configs", type=_int_at_least(1), default=len(CONFIGS),
                    help="how many of CONFIGS to run (default all)")
    ap.add_argument("--out", type=Path, help="folder for tma-stream.json")
    args = ap.parse_args()
    from minillm.benchutil import copy_bandwidth, environment, ms_graph, require_cuda

    require_cuda("probe_tma_stream.py")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    rec = dict(copy_gbps=round(bw, 1), environment=environment(), runs=[])
    print(f"copy rate {bw:.0f} GB/s")
    for rows, cols, swizzle, stages, per_sm in CONFIGS[:args.configs]:
        programs = sms * per_sm
        box_bytes = rows * cols * 2
        boxes = int(args.gbytes * 1e9) // (box_bytes * programs)
        buf = torch.randn(programs * boxes * rows, cols, dtype=torch.float16, device="cuda")
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        desc = TensorDescriptor(buf, list(buf.shape), list(buf.stride()), [rows, cols], layout)
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        for touch in (True, False):
            def run():
                _tma_stream_kernel[(programs,)](desc, out, boxes, STAGES=stages, BOX_R=rows, BOX_C=cols,
                                                TOUCH=touch, num_warps=8 if per_sm == 1 else 4)
            us = ms_graph([run]) * 1e3
            if touch:  # the sums say every box arrived
                ref = buf.view(programs, -1).float().sum(1)
                ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-1 * (boxes * box_bytes / 2) ** 0.5)
            r = dict(box=[rows, cols], swizzle=swizzle, stages=stages, programs_per_sm=per_sm, touch=touch,
                     in_flight_kb_per_sm=box_bytes * stages * per_sm // 1024, us=round(us, 1),
                     gbps=round(buf.numel() * 2 / us / 1e3, 1), of_copy=round(buf.numel() * 2 / us / 1e3 / bw, 3),
                     sums_ok=ok if touch else None)
            rec["runs"].append(r)
            print(json.dumps(r), flush=True)
        del buf
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tma-stream.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
