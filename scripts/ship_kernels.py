"""Build the shipped sm_90 kernels (``vc_compile/kernels/sm90``, read by ``vc_compile/runtime/shipped.py``).

    python -m scripts.ship_kernels record [--plan default] [--out vc_compile/kernels/sm90]   # on an sm_90 GPU
    python -m scripts.ship_kernels check                                                     # anywhere

``record``: for each call layout of the plan (the supported pipelines' attention at their usual sizes, B = 1,
q / k / v as the [B, S, H, D] projections viewed as [B, H, S, D], for each method) and each chain of its phases
(``prebuild.plan_chains``), the chain runs once with launches turned away (``prebuild.discover``: every kernel
and specialisation it launches), those are built in parallel into a fresh Triton cache, and the chain runs for
real (any kernel it builds then, found too late, is added). Each kernel's cubin (xz) and metadata go to the
output folder with ``manifest.json``. Triton's version and the kernels' sources are recorded: a kernel whose
source changed afterwards is never loaded (``check`` lists them: re-run ``record`` on a GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import sys
import tempfile
import time

# call layouts (B, H, S, D), bf16: Wan 2.1 1.3B 480p 81 frames (12 heads x 32760 tokens), Wan 2.1 14B 720p
# (40 x 75600) and 480p (40 x 32760); "wide" adds CogVideoX-5B 720 x 480, 49 frames (48 heads of 64 over 226 text
# + 17550 video tokens), the first head dim of 64
METHODS = {"vsmooth": {"method": "vsmooth"}, "vsmooth+expcast": {"method": "vsmooth", "expcast": True},
           "mcsparse": {"method": "mcsparse", "density": 0.15}}
SHAPES = {"default": [(1, 12, 32760, 128), (1, 40, 75600, 128), (1, 40, 32760, 128)],
          "small": [(1, 12, 32760, 128)],
          "wide": [(1, 12, 32760, 128), (1, 40, 75600, 128), (1, 40, 32760, 128), (1, 48, 17776, 64)]}


def request(opts: dict, B: int, H: int, S: int, D: int, dtype: str = "bfloat16", device: str = "cuda") -> dict:
    from vc_compile.config import VCConfig

    spec = {"shape": [B, H, S, D], "stride": [S * H * D, D, H * D, 1], "dtype": dtype, "device": device,
            "offset": 0}
    return {"config": VCConfig.from_options(dict(opts)).to_json(), "site": 1, "scale": None, "rope": "",
            "q": spec, "k": spec, "v": spec, "ident": None, "cos": None, "sin": None}


def add_kernel(kernels: dict, fn, spec: str, dev: int, out: str, fam: str):
    """Ship the kernel ``fn`` built for ``spec`` (in its in-memory cache on ``dev``): its cubin (xz) to ``out``,
    its manifest entry to ``kernels`` (by id), ``fam`` among its families. Returns its id (None: not built)."""
    key = json.loads(spec)["key"]
    k = fn.device_caches[dev][0].get(key)
    if k is None or hasattr(k, "result"):
        return None
    kid = k.hash[:24]
    if kid not in kernels:
        meta = next(p for n, p in k.metadata_group.items() if n.endswith(".json"))
        with open(meta) as f:
            metadata = json.load(f)
        fname = f"{kid}.cubin.xz"
        with lzma.open(os.path.join(out, fname), "wb", preset=9) as f:
            f.write(k.asm["cubin"])
        kernels[kid] = {"id": kid, "fn": f"{fn.fn.__module__}:{fn.fn.__qualname__}", "cache_key": fn.cache_key,
                        "name": k.name, "spec": spec, "metadata": metadata, "file": fname, "families": []}
    if fam not in kernels[kid]["families"]:
        kernels[kid]["families"].append(fam)
    return kid


def forget_launches(fns) -> None:
    """Make the next launch of each of ``fns`` go through Triton's binder and compile hooks again: their in-memory
    caches are cleared, and so are the process's remembered launches (``templates/launch.py``), which would
    otherwise launch an earlier chain's compiled kernel without the binder. A chain that only reuses a kernel
    another family recorded (ExpCast's preprocessing, V-Smooth's kernels) must still list it as its own, or the
    loader, which loads by family, leaves that kernel to be built at the first call."""
    from vc_compile.templates.launch import FAST_LAUNCH

    for fn in fns:
        fn.device_caches.clear()
    FAST_LAUNCH.clear()


def record(a) -> int:
    cache = tempfile.mkdtemp(prefix="vcattn_ship_")
    os.environ["TRITON_CACHE_DIR"] = cache  # every kernel is built here, none found from an earlier run
    import torch
    import triton
    from triton import knobs

    import vc_compile
    from vc_compile.config import VCConfig
    from vc_compile.runtime import prebuild, shipped

    os.makedirs(a.out, exist_ok=True)
    dev = torch.cuda.current_device()
    assert torch.cuda.get_device_capability(dev) == shipped.ARCH, "record on an sm_90 GPU"
    kernels, requests = {}, {}
    late, seen = [], set()

    def post(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        late.append((fn.jit_function, compile["specialization_data"]))

    t_all = time.time()
    for label in a.methods.split(","):
        for (B, H, S, D) in SHAPES[a.plan]:
            req = request(METHODS[label], B, H, S, D)
            cfg = VCConfig.from_json(req["config"])
            fam, ids = shipped.family(req), []
            for chain in prebuild.plan_chains(req):
                forget_launches(seen)  # kernels built for an earlier chain are found again (from the disk cache)
                job = dict(req, steps=chain)
                t = prebuild.inputs(job)
                t0 = time.time()
                found, why = prebuild.discover(job, t, cfg)
                built, errors = prebuild.build_parallel(found, dev)
                late.clear()
                knobs.runtime.jit_post_compile_hook = post
                try:
                    prebuild._steps_of(job, t, cfg)
                finally:
                    knobs.runtime.jit_post_compile_hook = None
                    vc_compile.reset(report=True)
                print(f"{label} {H}x{S}x{D} steps {chain}: {len(found)} found ({why or 'whole run'}), {built} built "
                      f"{errors or ''}, {len(late)} built late, {time.time() - t0:.1f} s", flush=True)
                seen.update(fn for fn, _ in found + list(late))
                for fn, spec in found + list(late):
                    kid = add_kernel(kernels, fn, spec, dev, a.out, fam)
                    if kid:
                        ids.append(kid)
            requests[shipped.match_key(req)] = {"family": fam, "shape": [B, H, S, D], "kernels": sorted(set(ids))}
    man = {"triton": triton.__version__, "arch": "sm_90", "gpu": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "kernels": sorted(kernels.values(), key=lambda e: e["id"]), "requests": requests}
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    keep = {e["file"] for e in kernels.values()} | {"manifest.json"}
    for n in os.listdir(a.out):
        if n not in keep:
            os.remove(os.path.join(a.out, n))
    size = sum(os.path.getsize(os.path.join(a.out, n)) for n in keep)
    print(f"{len(kernels)} kernels for {len(requests)} call layouts, {size / 2**20:.2f} MiB, "
          f"{time.time() - t_all:.0f} s -> {a.out}")
    return 0


def check(a) -> int:
    """Kernels whose source changed since they were recorded (never loaded), and the manifest's files."""
    from vc_compile.runtime import shipped

    with open(os.path.join(a.out, "manifest.json")) as f:
        man = json.load(f)
    stale, missing = [], []
    for e in man["kernels"]:
        try:
            fn = shipped._function(e["fn"])
        except (ImportError, AttributeError):
            stale.append(e["fn"])
            continue
        if fn.cache_key != e["cache_key"]:
            stale.append(e["fn"])
        if not os.path.exists(os.path.join(a.out, e["file"])):
            missing.append(e["file"])
    print(f"{len(man['kernels'])} kernels (triton {man['triton']}, {man['gpu']}, {man['date']}): "
          f"{len(stale)} stale, {len(missing)} missing")
    for s in sorted(set(stale)):
        print("  stale:", s)
    return 1 if stale or missing else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["record", "check"])
    ap.add_argument("--plan", default="default", choices=sorted(SHAPES))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.out is None:
        from vc_compile.runtime import shipped

        a.out = shipped.DIR
    return record(a) if a.what == "record" else check(a)


if __name__ == "__main__":
    sys.exit(main())
