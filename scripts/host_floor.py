"""The host-time floor of one attention call on this machine: what the primitives an op is made of cost.

    python3 -m scripts.host_floor [--n 2000] [--out F.json]

Per call, host (CPU) microseconds, the median of 5 rounds of ``--n`` back-to-back calls (the GPU work of each is
a few microseconds, so the launch queue never blocks the host):
* ``triton_jit``: an empty Triton kernel (one pointer, two ints) through ``kernel[grid](...)``, the JIT binder;
* ``triton_run``: the same compiled kernel through ``CompiledKernel.run`` (the path ``kernels/launch.py``'s
  ``FAST_LAUNCH`` takes after a call site's first launch);
* ``torch_empty``: ``torch.empty`` of 1 MiB on the GPU (the caching allocator's hit path);
* ``custom_op``: a ``torch.library.custom_op`` that returns ``torch.empty_like`` of its input, called through
  ``torch.ops`` (the dispatcher and the Python custom-op wrapper, as Inductor calls ``vcattn::attention``);
* ``sdpa``: ``F.scaled_dot_product_attention`` at B1 H2 S256 D128 bf16 (stock's whole host cost per call);
* ``graph_replay``: ``torch.cuda.CUDAGraph.replay`` of a captured graph of three empty Triton launches.
So an op of one custom-op call, k launches and m allocations cannot spend less than
``custom_op + k * triton_run + m * torch_empty`` on this host; the script prints that sum for the 8-bit reuse
step (3 launches, 6 allocations) and MC-Sparse's (1 launch, 1 allocation).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr, n, m):
    if n < 0:  # never: keeps the arguments live
        tl.store(x_ptr + m, 0.0)


def per_call_us(fn, n: int, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    grid = (1,)
    ck = _empty_kernel[grid](x, 5, 3)  # compiles; Triton 3.6 returns the CompiledKernel
    ck = ck if ck is not None else None
    res = {}
    res["triton_jit"] = per_call_us(lambda: _empty_kernel[grid](x, 5, 3), a.n)
    if ck is not None and hasattr(ck, "run"):
        stream = torch.cuda.current_stream().cuda_stream

        def direct():
            ck.run(1, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, x, 5, 3)
        direct()
        res["triton_run"] = per_call_us(direct, a.n)
    res["torch_empty"] = per_call_us(lambda: torch.empty(1 << 18, device=dev), a.n)

    @torch.library.custom_op("vcfloor::noop", mutates_args=())
    def noop(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    @noop.register_fake
    def _(t):
        return torch.empty_like(t)

    op = torch.ops.vcfloor.noop.default
    res["custom_op"] = per_call_us(lambda: op(x), a.n)
    q = torch.randn(1, 2, 256, 128, device=dev, dtype=torch.bfloat16)
    res["sdpa"] = per_call_us(lambda: F.scaled_dot_product_attention(q, q, q), a.n)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _empty_kernel[grid](x, 5, 3)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(3):
            _empty_kernel[grid](x, 5, 3)
    res["graph_replay"] = per_call_us(g.replay, a.n)
    run = res.get("triton_run", res["triton_jit"])
    res["floor_8bit_reuse"] = res["custom_op"] + 3 * run + 6 * res["torch_empty"]
    res["floor_mcsparse_reuse"] = res["custom_op"] + run + res["torch_empty"]
    res["floor_graph"] = res["custom_op"] + res["graph_replay"] + res["torch_empty"]
    res["device"] = torch.cuda.get_device_name(dev)
    res["torch"] = torch.__version__
    res["triton"] = triton.__version__
    for k, v in res.items():
        print(f"{k:22s} {v:.1f} us" if isinstance(v, float) else f"{k:22s} {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
