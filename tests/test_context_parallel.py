"""vcattn under context parallelism, two CPU processes over gloo.

One module-scoped fixture launches two worker processes (this file run as a script, ``--worker``;
no torchrun, a free port on 127.0.0.1, gloo on the loopback interface, bounded timeouts everywhere).
Each worker builds the same tiny diffusers ``WanTransformer3DModel`` (2 layers, 2 heads x 64, 256 video
tokens), computes the single-process references itself (fp32 and bf16 eager, and V-Smooth compiled
without parallelism), then enables Ulysses context parallelism (diffusers' own hooks and
``TemplatedUlyssesAttention``, via ``vc_compile.parallel.enable_diffusers_ulysses`` because diffusers'
``enable_parallelism`` divides by the accelerator count, 0 on CPU) and compiles it with vcattn for each
method. Every rank reports counters, report() data, its metadata and its errors as JSON; the tests
assert on those.

Tolerances:
* dense: the op runs stock SDPA on the same head data as a single process -> within bf16 rounding of the
  single-process run (the rest of the model splits/gathers tokens, which reorders nothing per token).
* vsmooth: both the single-process and the Ulysses run are compared to the fp32 model; the Ulysses
  error must be the single-process error (x1.25 + 1e-3), and the two must agree with each other far more
  closely than either agrees with fp32 (each head's metadata is computed from the same full sequence).
* mcsparse at density 1.0: keeps every key, so anchor (dense + residual) and reuse (sparse + residual)
  steps reproduce the Ulysses dense run to rounding.

Step detection is exercised in every form: the timestep input or call counting (dense), explicit
``vc_compile.sampling``/``step`` (vsmooth), a diffusers-style pipeline frame (mcsparse), and per-token
timesteps that Wan's ``_cp_plan`` splits across ranks so that rank 0 holds only t = 0 tokens
(vsmooth_t2d); both ranks must see the same phases, and each case must stay one graph for all steps.
Runtime: ~60-80 s on 2 shared cores (two interpreters importing torch + diffusers, 8 small compiles). A test-only ring attention (KV chunks all-gathered, partial outputs merged by
LSE, the pattern of diffusers' ``TemplatedRingAttention``, which cannot run on CPU) checks that ring
stays stock with its reason in ``vc_compile.report()``.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from vc_compile.config import VCConfig

WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 4
MIN_SEQ = 32
TIMESTEPS = [999, 749, 499, 249]
WORKER_TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------------
# worker side (runs in the spawned processes)
# ------------------------------------------------------------------------------------------------
def _make_wan():
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                              in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128,
                              num_layers=2, rope_max_seq_len=64).eval()
    with torch.no_grad():  # peaked attention (random weights give a near-uniform softmax)
        for b in m.blocks:
            b.attn1.to_q.weight.mul_(4.0)
            b.attn1.to_k.weight.mul_(4.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 2, 16, 32, generator=g)  # 2 x 8 x 16 = 256 tokens after the 1x2x2 patch
    ctx = torch.randn(1, 8, 32, generator=g)
    return m, x, ctx


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _wired_backend(options):
    """backend="vcattn" plus the context-parallel detection hook (what backend.py will call once wired)."""
    from vc_compile.backend import vcattn
    from vc_compile.config import VCConfig
    from vc_compile.passes import cp_detect

    cfg = VCConfig.from_options(options)

    def backend(gm, example_inputs):
        cp_detect.detect_context_parallel(gm, cfg, graph_name="cp_test")
        return vcattn(gm, example_inputs, options=options)

    return backend


class _FakePipeline:
    """Looks like a diffusers pipeline to vc_compile's step tracker: a ``__call__`` frame with ``i``,
    ``timesteps`` and a ``self`` that has a scheduler."""
    scheduler = object()

    def __call__(self, model, x, ctx):
        import torch

        timesteps = torch.tensor(TIMESTEPS)
        outs = []
        for i, t in enumerate(timesteps):
            outs.append(model(x, t.reshape(1), ctx, return_dict=False)[0].float())
        return outs


def _run_steps(model, x, ctx, driver):
    import torch

    import vc_compile

    with torch.no_grad():
        if driver == "diffusers":
            return _FakePipeline()(model, x, ctx)
        outs = []
        if driver == "explicit":
            with vc_compile.sampling(num_steps=STEPS):
                for i, t in enumerate(TIMESTEPS):
                    vc_compile.step(i)
                    outs.append(model(x, torch.tensor([t]), ctx, return_dict=False)[0].float())
            return outs
        if driver == "timestep-2d":  # Wan 2.2 TI2V style: one timestep per token, first frame at t = 0
            S = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
            for t in TIMESTEPS:
                ts = torch.full((1, S), t, dtype=torch.int64)
                ts[:, :S // x.shape[2]] = 0  # the first latent frame (the conditioning image)
                outs.append(model(x, ts, ctx, return_dict=False)[0].float())
            return outs
        for t in TIMESTEPS:  # no step signal but the timestep input (or, failing that, call counting)
            outs.append(model(x, torch.tensor([t]), ctx, return_dict=False)[0].float())
        return outs


def _site_summary():
    import vc_compile

    rep = vc_compile.report()
    return [{"shape": s.shape, "rewritten": s.rewritten, "reason": s.reason, "calls": s.calls,
             "phases": dict(s.phases), "step_sources": dict(s.step_sources),
             "runtime_fallbacks": dict(s.runtime_fallbacks),
             "has_identity": s.has_identity, "bytes_held": s.bytes_held} for s in rep.sites]


def _meta_summary():
    """Every metadata entry this rank holds: the parts of its key and what is inside."""
    from vc_compile.runtime import state

    out = []
    items = sorted(((k, m) for k, m in state.items() if m is not None), key=lambda kv: (kv[0][0], kv[0][2]))
    for key, meta in items:
        site, ident, branch = key[:3]  # (site, block identity, branch, q shape, k shape, device)
        shapes = [x for x in key[3:] if isinstance(x, tuple)]
        d = {"site": site, "ident": ident != 0, "branch": branch, "qshape": list(shapes[0]) if shapes else None,
             "device": next((x for x in key[3:] if isinstance(x, str)), "?"), "type": type(meta).__name__}
        if hasattr(meta, "perm"):
            d["perm_shape"] = list(meta.perm.shape)
        if hasattr(meta, "sigma"):
            d["sigma_shape"] = list(meta.sigma.shape)
            d["idx_shape"] = list(meta.idx.shape)
            d["density"] = meta.density
        out.append(d)
    return out, items


def _case(m, x, ctx, options, driver):
    import torch
    from torch._dynamo.utils import counters

    import vc_compile
    from vc_compile.passes import cp_detect

    torch._dynamo.reset()
    counters.clear()
    cp_detect.clear()
    vc_compile.reset(report=True)
    t0 = time.perf_counter()
    cm = torch.compile(m, backend=_wired_backend(options))
    outs = _run_steps(cm, x, ctx, driver)
    meta, items = _meta_summary()
    return outs, items, {
        "rewrite": counters["vcattn"]["rewrite"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "counters": dict(counters["vcattn"]),
        "cp_kinds": sorted({f.kind for f in cp_detect.findings()}),
        "sites": _site_summary(),
        "meta": meta,
        "seconds": time.perf_counter() - t0,
    }


def _ring_case(rank, world):
    """A test-only ring attention block: all-gather KV chunks, LSE-returning kernel per chunk, merge."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import vc_compile
    from vc_compile.passes import cp_detect

    class RingBlock(nn.Module):
        def __init__(self, dim=128, heads=2, rank=0, world=1):
            super().__init__()
            self.h, self.rank, self.world = heads, rank, world
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

        def attend(self, q, k, v):  # [B, H, S_loc, D]
            kv = torch.cat([k.flatten(), v.flatten()])
            kv = funcol.all_gather_tensor(kv, 0, dist.group.WORLD)
            if isinstance(kv, funcol.AsyncCollectiveTensor):
                kv = kv.wait()
            chunks = kv.chunk(self.world)
            out = lse = None
            for i in range(self.world):
                c = chunks[(self.rank + i) % self.world]
                kc, vc = c[:k.numel()].view_as(k), c[k.numel():].view_as(v)
                o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kc, vc)[:2]
                o, l = o.float(), l.float().unsqueeze(-1)
                if out is None:
                    out, lse = o, l
                else:
                    out = out - torch.sigmoid(l - lse) * (out - o)
                    lse = lse - F.logsigmoid(lse - l)
            return out.to(q.dtype)

        def forward(self, x, ring=True):
            q, k, v = (f(x).unflatten(-1, (self.h, -1)).transpose(1, 2) for f in (self.q, self.k, self.v))
            o = self.attend(q, k, v) if ring else F.scaled_dot_product_attention(q, k, v)
            return self.o(o.transpose(1, 2).flatten(2))

    torch.manual_seed(0)
    blk = RingBlock(rank=rank, world=world).to(torch.bfloat16).eval()
    x = torch.randn(1, 256, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    S_loc = x.shape[1] // world
    with torch.no_grad():
        ref = blk(x, ring=False).float()[:, rank * S_loc:(rank + 1) * S_loc]
    torch._dynamo.reset()
    counters.clear()
    cp_detect.clear()
    vc_compile.reset(report=True)
    opts = {"experimental": {"compiler": "eager"}, "min_seq_len": MIN_SEQ, "method": "vsmooth"}
    cm = torch.compile(blk, backend=_wired_backend(opts))
    with torch.no_grad():
        out = cm(x[:, rank * S_loc:(rank + 1) * S_loc]).float()
    return {"rel_vs_single": _rel(out, ref), "rewrite": counters["vcattn"]["rewrite"],
            "counters": dict(counters["vcattn"]),
            "cp_kinds": sorted({f.kind for f in cp_detect.findings()}),
            "sites": _site_summary()}


def _ulysses_helper_case(rank, world):
    """vc_compile.parallel.ulysses_attention (for models of your own) against single-process SDPA."""
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import vc_compile
    from vc_compile import parallel
    from vc_compile.passes import cp_detect

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 256, 4, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    S_loc = 256 // world
    sl = slice(rank * S_loc, (rank + 1) * S_loc)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)[:, sl]
    torch._dynamo.reset()
    counters.clear()
    cp_detect.clear()
    vc_compile.reset(report=True)
    opts = {"experimental": {"compiler": "eager"}, "min_seq_len": MIN_SEQ, "method": "dense"}
    fn = torch.compile(lambda a, b, c: parallel.ulysses_attention(a, b, c), backend=_wired_backend(opts))
    with torch.no_grad():
        out = fn(q[:, sl], k[:, sl], v[:, sl])
    # the DTensor guard (torch's own context_parallel): an SDPA on DTensors must stay stock
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    dq = DTensor.from_local(q[:, sl].transpose(1, 2), mesh, [Shard(2)], run_check=False)
    return {"max_abs_vs_single": (out.float() - ref.float()).abs().max().item(),
            "rewrite": counters["vcattn"]["rewrite"],
            "cp_kinds": sorted({f.kind for f in cp_detect.findings()}),
            "sites": _site_summary(),
            "dtensor_reason": cp_detect.dtensor_reason(dq, dq, dq),
            "plain_reason": cp_detect.dtensor_reason(q, k, v)}


def worker_main(rank, world, port, out_path):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes on a shared 2-core machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    res = {"rank": rank, "timings": {}}
    try:
        import vc_compile
        from vc_compile.parallel import enable_diffusers_ulysses

        t0 = time.perf_counter()
        m32, x, ctx = _make_wan()
        m = _make_wan()[0].to(torch.bfloat16)
        xb, ctxb = x.to(torch.bfloat16), ctx.to(torch.bfloat16)
        # single-process references (every rank computes them: same weights, same inputs)
        ref32 = _run_steps(m32, x, ctx, "call-count")
        ref16 = _run_steps(m, xb, ctxb, "call-count")
        del m32
        vs_opts = {"experimental": {"compiler": "eager"}, "min_seq_len": MIN_SEQ, "method": "vsmooth"}
        vs_single, vs_single_items, vs_single_info = _case(m, xb, ctxb, vs_opts, "explicit")
        res["timings"]["references"] = time.perf_counter() - t0

        # diffusers' enable_parallelism on CPU: does it work as is?
        from diffusers.models._modeling_parallel import ContextParallelConfig

        probe = _make_wan()[0]
        try:
            probe.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
            res["diffusers_enable_parallelism"] = "ok"
        except Exception as e:  # diffusers 0.42.1: rank % torch.accelerator.device_count() == rank % 0
            res["diffusers_enable_parallelism"] = f"{type(e).__name__}: {e}"
        del probe

        enable_diffusers_ulysses(m, world)
        cases = {
            "dense": ({"experimental": {"compiler": "eager"}, "min_seq_len": MIN_SEQ, "method": "dense",
                       "num_steps": STEPS},
                      "call-count"),
            "vsmooth": (vs_opts, "explicit"),
            "mcsparse": ({"experimental": {"compiler": "eager"}, "min_seq_len": MIN_SEQ, "method": "mcsparse",
                          "density": 1.0,
                          "warmup_steps": 1, "anchor_steps": (1,)}, "diffusers"),
            # per-token timesteps are split across ranks by Wan's _cp_plan: rank 0 holds only t = 0 tokens
            "vsmooth_t2d": ({**vs_opts, "num_steps": STEPS}, "timestep-2d"),
        }
        outs = {}
        for name, (opts, driver) in cases.items():
            outs[name], items, info = _case(m, xb, ctxb, opts, driver)
            res[name] = info
            if name == "vsmooth":  # rank r's heads are global heads [r*Hl, (r+1)*Hl): same metadata?
                agree = []
                for (_, a), (_, b) in zip(items, vs_single_items):
                    Hl = a.perm.shape[1]
                    agree.append((a.perm == b.perm[:, rank * Hl:(rank + 1) * Hl]).float().mean().item())
                res[name]["perm_agreement_with_single"] = agree
        stack = lambda xs: torch.stack(xs)  # noqa: E731
        r32, r16 = stack(ref32), stack(ref16)
        res["dense"]["rel_vs_single_bf16"] = _rel(stack(outs["dense"]), r16)
        res["dense"]["rel_single_bf16_vs_fp32"] = _rel(r16, r32)
        res["vsmooth"]["rel_vs_fp32"] = _rel(stack(outs["vsmooth"]), r32)
        res["vsmooth"]["single_rel_vs_fp32"] = _rel(stack(vs_single), r32)
        res["vsmooth"]["rel_vs_single"] = _rel(stack(outs["vsmooth"]), stack(vs_single))
        res["vsmooth"]["single_info"] = vs_single_info
        res["mcsparse"]["rel_vs_dense"] = _rel(stack(outs["mcsparse"]), stack(outs["dense"]))
        res["mcsparse"]["rel_vs_single_bf16"] = _rel(stack(outs["mcsparse"]), r16)
        res["timings"]["ulysses_cases"] = time.perf_counter() - t0

        res["ring"] = _ring_case(rank, world)
        res["helper"] = _ulysses_helper_case(rank, world)
        res["timings"]["total"] = time.perf_counter() - t0
        res["ok"] = True
    except Exception:
        import traceback

        res["ok"] = False
        res["error"] = traceback.format_exc()
    finally:
        with open(out_path, "w") as f:
            json.dump(res, f)
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# ------------------------------------------------------------------------------------------------
# test side
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=HERE)
    procs, paths = [], []
    for r in range(WORLD):
        path = str(tmp_path / f"rank{r}.json")
        paths.append(path)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(WORLD), str(port), path],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:  # only the processes this test started, by their handles
            p.kill()
        pytest.fail(f"context-parallel workers did not finish within {WORKER_TIMEOUT_S}s")
    results = []
    for r, (p, path) in enumerate(zip(procs, paths)):
        if not os.path.exists(path):
            return None, logs
        with open(path) as f:
            results.append(json.load(f))
    return results, logs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("diffusers")
    for attempt in range(2):  # the free port can be taken between probing and binding: retry once
        results, logs = _launch(tmp_path_factory.mktemp("cp"))
        if results is not None or "address already in use" not in "".join(logs).lower():
            break
    assert results is not None, "a worker wrote no result:\n" + "\n-----\n".join(l[-3000:] for l in logs)
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r} failed:\n{res.get('error', '')}\n{logs[r][-3000:]}"
    return results


def test_diffusers_enable_parallelism_on_cpu_is_reported(ranks):
    # Documents diffusers 0.42.1's behaviour (docs/context_parallel.md): enable_parallelism resolves the
    # device as rank % torch.accelerator.device_count(), 0 on CPU. If a diffusers release fixes it,
    # this records "ok" and enable_diffusers_ulysses can simply call enable_parallelism.
    for res in ranks:
        v = res["diffusers_enable_parallelism"]
        assert v == "ok" or v.startswith("ZeroDivisionError"), v


ULYSSES_CASES = ["dense", "vsmooth", "mcsparse", "vsmooth_t2d"]


@pytest.mark.parametrize("case", ULYSSES_CASES)
def test_local_attention_rewritten_on_every_rank(ranks, case):
    for res in ranks:
        r = res[case]
        assert r["rewrite"] == 2, r["counters"]  # the two self-attentions of the two blocks
        assert r["counters"].get("fallback:cross-attention too short") == 2  # text cross-attention
        assert r["cp_kinds"] == ["ulysses"], r["cp_kinds"]
        # one graph for all four steps: no recompiles on step changes, no fragments (hooks primed)
        assert r["unique_graphs"] == 1, r
        rewritten = [s for s in r["sites"] if s["rewritten"]]
        assert len(rewritten) == 2
        for s in rewritten:
            # B x H/N x S x D: one of the two heads, all 256 tokens (the all-to-all happened before)
            assert s["shape"] == "1x1x256x64", s
            assert s["calls"] == STEPS and s["has_identity"] and not s["runtime_fallbacks"], s
    assert len({res[case]["rewrite"] for res in ranks}) == 1


def test_phases_and_step_sources_agree_across_ranks(ranks):
    implicit = ("timestep", "call-count")  # no explicit API, no pipeline frame: timestep input, else calls
    expected = {
        "dense": ({"dense": STEPS}, implicit),
        "vsmooth": ({"group": 1, "reuse": 3}, ("explicit",)),  # 1 grouping step (step 0)
        "mcsparse": ({"warmup": 1, "anchor": 1, "reuse": 2}, ("diffusers",)),
        # rank 0's half of the per-token timesteps is all zeros: it must still step like rank 1
        "vsmooth_t2d": ({"group": 1, "reuse": 3}, implicit),
    }
    for case, (phases, sources) in expected.items():
        per_rank = [[(s["phases"], s["step_sources"]) for s in res[case]["sites"] if s["rewritten"]]
                    for res in ranks]
        assert all(p == per_rank[0] for p in per_rank), (case, per_rank)
        for ph, src in per_rank[0]:
            assert ph == phases, (case, ph)
            assert len(src) == 1 and next(iter(src)) in sources and sum(src.values()) == STEPS, (case, src)


def test_metadata_is_per_rank_and_per_block(ranks):
    for res in ranks:
        for method, field in (("vsmooth", "perm_shape"), ("mcsparse", "sigma_shape")):
            meta = res[method]["meta"]
            assert len(meta) == 2, meta  # one entry per block (one branch, one shape)
            assert len({m["site"] for m in meta}) == 2
            for m in meta:
                assert m["ident"] and m["branch"] == 0 and m["device"] == "cpu"
                assert m["qshape"] == [1, 1, 256, 64]  # the local heads only
                assert m[field] == [1, 1, 256]
        groups = 256 // VCConfig().group_size  # the default query groups of the 256 local tokens
        for m in res["mcsparse"]["meta"]:
            assert m["density"] == 1.0 and m["idx_shape"] == [1, 1, groups, 256]  # key by key: no memory plan
        assert all(s["bytes_held"] > 0 for s in res["vsmooth"]["sites"] if s["rewritten"])
    # each rank's V-Smooth permutation is the single-process permutation of the head it owns
    for res in ranks:
        assert min(res["vsmooth"]["perm_agreement_with_single"]) > 0.9, res["vsmooth"]


def test_dense_matches_single_process(ranks):
    for res in ranks:
        d = res["dense"]
        # same SDPA on the same head data; only bf16 rounding of the surrounding ops may differ
        assert d["rel_vs_single_bf16"] <= max(1e-3, 0.25 * d["rel_single_bf16_vs_fp32"]), d


def test_vsmooth_error_matches_single_process(ranks):
    for res in ranks:
        v = res["vsmooth"]
        assert v["single_rel_vs_fp32"] < 5e-2, v
        assert v["rel_vs_fp32"] <= 1.25 * v["single_rel_vs_fp32"] + 1e-3, v
        assert v["rel_vs_single"] < 0.5 * v["single_rel_vs_fp32"], v


def test_mcsparse_full_density_equals_dense(ranks):
    for res in ranks:
        s = res["mcsparse"]
        assert s["rel_vs_dense"] < 1e-2, s
        assert s["rel_vs_single_bf16"] < 1e-2, s


def test_ranks_agree_on_outputs(ranks):
    # every rank gathers the full output (proj_out gather), so the errors are the same numbers
    for key in (("dense", "rel_vs_single_bf16"), ("vsmooth", "rel_vs_fp32"), ("mcsparse", "rel_vs_dense")):
        vals = [res[key[0]][key[1]] for res in ranks]
        assert max(vals) - min(vals) <= 1e-6, (key, vals)


def test_ring_attention_detected_and_left_stock(ranks):
    from vc_compile.passes.cp_detect import RING_COUNTER, RING_REASON

    for res in ranks:
        r = res["ring"]
        assert r["rewrite"] == 0, r
        assert r["cp_kinds"] == ["ring"], r
        assert r["counters"].get(RING_COUNTER) == WORLD, r  # one LSE-returning call per KV chunk
        ring_sites = [s for s in r["sites"] if not s["rewritten"]]
        assert len(ring_sites) == WORLD and all(s["reason"] == RING_REASON for s in ring_sites), r
        assert r["rel_vs_single"] < 1e-2, r  # stock ring attention = single-process attention


def test_ulysses_helper_and_dtensor_guard(ranks):
    from vc_compile.passes.cp_detect import DTENSOR_REASON

    for res in ranks:
        h = res["helper"]
        assert h["rewrite"] == 1 and h["cp_kinds"] == ["ulysses"], h
        assert [s["shape"] for s in h["sites"]] == ["1x2x256x64"], h  # 4 heads / 2 ranks, all tokens
        assert h["max_abs_vs_single"] < 1e-2, h
        assert h["dtensor_reason"] == DTENSOR_REASON and h["plain_reason"] is None, h


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    sys.path.insert(0, HERE)
    if not os.environ.get("TRITON_INTERPRET"):
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    worker_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
