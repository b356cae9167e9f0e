"""CUDA graph capture: the one way the package captures (the engine's decode and prefill steps,
the torch-compile peer, the kernel benchmarks' ms_graph)."""
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
