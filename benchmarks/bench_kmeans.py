"""What a V-Smooth grouping step costs: the k-means kernel by its parts, beside the reuse call it precedes.

    python -m benchmarks.bench_kmeans                           # GPU: the 1.3B and 14B pipeline shapes
    python -m benchmarks.bench_kmeans --shapes 12x32760 --smoke  # CPU: tiny shapes, reference kernels, no rows

Per (H, S) (B = 1, D = 128, bf16, ``bench_vsmooth_attn.make_inputs``: V in 64 clusters per head plus 1% token
outliers), the call a grouping step makes (``methods/vsmooth.run``'s arguments: K = ``default_clusters(S)``,
``kmeans_iters`` Lloyd iterations warm-started from the centroids of a first cold grouping of the same V, the
iterations on every ``sample_stride``-th row, then one assignment of every row):

* ``kmeans``: ``kernels/kmeans.kmeans_perm`` whole; ``group_call`` / ``reuse_call``: the method's whole op on a
  grouping step (k-means, preprocessing, attention) and on a reuse step (the grouping given), without CUDA
  graphs; ``reference``: ``reference/kmeans.kmeans_perm`` (plain PyTorch) on the same inputs, the baseline.
* the parts, from one profiled call: ``kmeans:<part>`` = GPU time of its assign / update / final / sort / other
  kernels (``ms`` per call).
* the alternatives: ``sort int32`` / ``sort uint8`` (``torch.sort(labels, stable=True)`` on the int32 labels and
  on the same labels as uint8, K <= 256: one radix pass instead of four), ``assign hi+lo`` / ``assign hi`` (the
  every-row assignment with the centroids split into two bf16 MMAs, and with the high part only).

``ms``: CUDA events around 20 calls back to back / 20 (median of 5 bursts); ``host_ms``: their wall time per
call. Accuracy beside speed: ``inertia_x`` = the grouping's inertia (sum of squared distances of the rows to
their centroid) over the reference's, ``labels_equal`` = fraction of rows with the reference's label; for the
alternatives, against the kernel's own labels. Rows go to ``benchmarks/results/bench_kmeans.csv``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_vsmooth_attn import make_inputs
from benchmarks.common import append_rows, kernel_times, print_table
from vc_compile.config import VCConfig
from vc_compile.kernels import dispatch
from vc_compile.methods import vsmooth
from vc_compile.methods.phase import Phase
from vc_compile.reference import kmeans as ref_kmeans
from vc_compile.torch_ops import default_clusters, sample_stride

BENCH = "bench_kmeans"
SHAPES = ((12, 32760), (40, 75600))  # Wan 2.1 1.3B at 480p, 14B at 720p (81 frames)
EXTRAS = ["host_ms", "x_reuse_call", "inertia_x", "labels_equal", "K", "iters", "sample", "note"]
PARTS = (("assign", "_assign_kernel"), ("update", "_update_partial_kernel"), ("final", "_update_final_kernel"),
         ("sort", "sort"), ("sort", "radix"), ("sort", "Sort"))


def log(*a):
    print(*a, flush=True)


def burst(fn, cuda: bool, n: int = 20, reps: int = 5):
    """(GPU ms, host ms) per call: median over ``reps`` bursts of n calls back to back."""
    fn()
    gpu, host = [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) * 1e3 / n)
        if cuda:
            b.record()
            b.synchronize()
            gpu.append(a.elapsed_time(b) / n)
        else:
            gpu.append(host[-1])
    return statistics.median(gpu), statistics.median(host)


def parts(fn) -> dict:
    """GPU ms per part of one call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = {}
    for name, ms in kernel_times(prof).items():
        part = next((p for p, key in PARTS if key in name), "other")
        out[part] = out.get(part, 0.0) + ms
        log(f"    {ms * 1e3:8.1f} us  {name[:90]}")
    return out


def inertia(x, labels, cent) -> float:
    c = torch.gather(cent.float(), 2, labels.long().unsqueeze(-1).expand(*labels.shape, x.shape[-1]))
    return (x.float() - c).pow(2).sum().item()


def bench_shape(H, S, smoke: bool):
    cuda = torch.cuda.is_available() and not smoke
    impl = dispatch.Impl.TRITON if cuda else dispatch.Impl.REFERENCE
    kern = dispatch.kernel_module("kmeans") if cuda else ref_kmeans
    q, k, v = make_inputs(1, H, S, 128)
    if not cuda:
        q, k, v = (t.float() for t in (q, k, v))
    cfg = VCConfig(method="vsmooth", expcast=True)
    K = min(cfg.kmeans_clusters or default_clusters(S), S)
    st = sample_stride(S, K, cfg.experimental.kmeans_sample)
    iters = cfg.kmeans_iters
    cold = kern.kmeans_perm(v, K, cfg.experimental.kmeans_init_iters, sample=st)
    init = cold.centroids
    base = dict(B=1, H=H, S=S, D=128, density="", K=K, iters=iters, sample=st)
    log(f"\n=== H={H} S={S} K={K} iterations={iters} row stride={st} ===")

    def km():
        return kern.kmeans_perm(v, K, iters, init=init, sample=st)

    ref = ref_kmeans.kmeans_perm(v, K, iters, init=init, sample=st)
    ref_in = inertia(v, ref.labels, ref.centroids)
    out = km()
    rows = []
    sm = 128 ** -0.5
    meta = vsmooth.VSmoothMeta(perm=out.perm, centroids=out.centroids)

    def call(phase):
        return lambda: vsmooth.run(q, k, v, phase=phase, meta=meta, cfg=cfg, sm_scale=sm, impl=impl)

    reuse_ms, reuse_host = burst(call(Phase.REUSE), cuda)
    for variant, fn, acc in (
            ("reuse_call", call(Phase.REUSE), {}),
            ("group_call", call(Phase.GROUP), {}),
            ("kmeans", km, dict(inertia_x=inertia(v, out.labels, out.centroids) / ref_in,
                                labels_equal=(out.labels == ref.labels).float().mean().item())),
            ("reference", lambda: ref_kmeans.kmeans_perm(v, K, iters, init=init, sample=st),
             dict(inertia_x=1.0, labels_equal=1.0))):
        ms, host = (reuse_ms, reuse_host) if variant == "reuse_call" else burst(fn, cuda)
        rows.append(dict(base, variant=variant, ms=ms, host_ms=host, x_reuse_call=ms / reuse_ms, **acc))
    if not cuda:
        return rows
    for part, ms in sorted(parts(km).items()):
        rows.append(dict(base, variant=f"kmeans:{part}", ms=ms, x_reuse_call=ms / reuse_ms))
    # the alternatives, each beside the kernel's own choice
    lab32 = out.labels.to(torch.int32).view(H, S)
    lab8 = lab32.to(torch.uint8)
    p32 = torch.sort(lab32, dim=-1, stable=True).indices
    p8 = torch.sort(lab8, dim=-1, stable=True).indices
    same = (p32 == p8).float().mean().item()
    for variant, fn in (("sort int32", lambda: torch.sort(lab32, dim=-1, stable=True)),
                        ("sort uint8", lambda: torch.sort(lab8, dim=-1, stable=True))):
        ms, host = burst(fn, cuda)
        rows.append(dict(base, variant=variant, ms=ms, host_ms=host, x_reuse_call=ms / reuse_ms, labels_equal=same))
    rows += assign_ab(kern, v, out, base, reuse_ms)
    return rows


def assign_ab(kern, v, out, base, reuse_ms):
    """The every-row assignment with the hi/lo split (the kernel's) and with the high part only."""
    import triton

    B, H, S, D = v.shape
    K = out.centroids.shape[2]
    c = out.centroids.reshape(B * H, K, D).contiguous()
    c_hi = c.to(v.dtype)
    c_lo = (c - c_hi.float()).to(v.dtype)
    c2 = (c * c).sum(-1)
    BS, BKC = 128, min(128, max(16, triton.next_power_of_2(K)))
    n_kc = triton.cdiv(K, BKC)
    rows, labels = [], {}
    for variant, split in (("assign hi+lo", True), ("assign hi", False)):
        lab = torch.empty(B * H, S, device=v.device, dtype=torch.int32)

        def fn(split=split, lab=lab):
            kern._assign_kernel[(triton.cdiv(S, BS), B * H)](
                v, c_hi, c_lo, c2, lab, S, H, K, *v.stride(), n_kc, n_kc, D=D, BS=BS, BKC=BKC, SPLIT=split,
                DOT_PREC=None, INTERPRET=False, num_warps=8)
        ms, host = burst(fn, True)
        labels[variant] = lab.view(B, H, S)
        rows.append(dict(base, variant=variant, ms=ms, host_ms=host, x_reuse_call=ms / reuse_ms,
                         inertia_x=inertia(v, labels[variant], out.centroids)
                         / inertia(v, labels["assign hi+lo"], out.centroids),
                         labels_equal=(labels[variant] == labels["assign hi+lo"]).float().mean().item()))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help="HxS list, e.g. 12x32760,40x75600 (default: both pipelines')")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, reference kernels, no rows")
    a = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")] if a.shapes else list(SHAPES)
    if a.smoke:
        shapes = [(2, 1024)]
    rows = []
    for H, S in shapes:
        rows += bench_shape(H, S, a.smoke)
    print_table(rows, ["variant", "H", "S", "K", "ms", "host_ms", "x_reuse_call", "inertia_x", "labels_equal"])
    if not a.smoke and torch.cuda.is_available():
        log("rows ->", append_rows(BENCH, rows, extras=EXTRAS))


if __name__ == "__main__":
    main()
