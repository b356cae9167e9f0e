"""CUDA graph capture: the one way the package captures (the engine's decode and prefill steps,
the torch-compile peer, the kernel benchmarks' ms_graph), and the staged inputs a captured
prefill reads."""
import torch


def capture(fn, warmups=0, warm=None):
    """(graph, what fn returned inside it): `warm` (default fn) runs `warmups` times on a side
    stream (compilation, autotuning, workspace allocation), then fn is captured on that stream.

    The stream is the current device's, passed to torch.cuda.graph: without one torch captures on
    a default capture stream that it makes once a process, on the device current then, and the
    capture switches to that stream's device. A model on cuda:1 after one on cuda:0 then captured
    on cuda:0, whose context cannot address its tensors (Triton: "Pointer argument cannot be
    accessed"; found on a two-GPU H200 host, bench/results/h200/session-99/)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


class StagedInputs:
    """A captured prefill's inputs, the prompts' ids (B, T) int64 and lengths (B,) int32, as views
    of one device buffer that one asynchronous copy fills from pinned host memory. From pageable
    memory each tensor took its own copy, which the driver stages through a buffer of its own and
    may hold the host for until the stream drains; both copies lie on the time to first token's
    path."""

    def __init__(self, batch, length, device):
        n = 2 * batch * length + batch  # int32 words: the ids' int64 pairs, then the lengths
        self.buffer = torch.empty(n, dtype=torch.int32, device=device)  # what the graph reads
        self.host = torch.empty(n, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        self.ids, self.host_ids = (t[:2 * batch * length].view(torch.int64).view(batch, length)
                                   for t in (self.buffer, self.host))
        self.lens, self.host_lens = (t[2 * batch * length:] for t in (self.buffer, self.host))

    def load(self, ids, lens):
        """Copy ids (B, T) int64 and lens (B,) int32, host tensors, to the device views. The host
        buffer is rewritten at the next call's load: callers wait for the device between calls."""
        self.host_ids.copy_(ids)
        self.host_lens.copy_(lens)
        self.buffer.copy_(self.host, non_blocking=True)
