"""Recorded reuse steps (kernels/programs.py): a replayed program hands each kernel's launcher what the normal path
hands it, on the call's own tensors; a call it cannot reproduce is never recorded, and says why."""

import pytest
import torch

from conftest import requires_cuda
from offline_sm90 import result_line
from vc_compile.kernels import programs as P


def test_a_torch_operation_in_the_call_refuses_the_recording():
    """A computation the program could not redo (here an add) leaves the call unrecorded, with its name."""
    q = torch.randn(2, 3)
    out, rec = P.record(lambda q, k, v: q + 1, q, q, q)
    assert torch.equal(out, q + 1)
    prog, why = P.build(rec, out, q, q, q)
    assert prog is None and "torch operation (add)" in why


def test_allocations_and_views_are_allowed_but_a_call_without_launches_is_not_a_program():
    q = torch.randn(2, 3)

    def fn(q, k, v):
        out = torch.empty(4, 6)
        return out.view(24)[:6].view(2, 3)
    out, rec = P.record(fn, q, q, q)
    assert rec.problem is None and len(rec.allocs) == 1
    assert P.build(rec, out, q, q, q) == (None, "no launch recorded")


def test_the_layout_key_tells_apart_what_a_program_depends_on():
    x = torch.randn(1, 8, 2, 16)
    q, k = x.transpose(1, 2), x.transpose(1, 2).contiguous()
    base = P.layout_key(q, q.clone(), q.clone())
    assert base == P.layout_key(q, q.clone(), q.clone())
    assert base != P.layout_key(k, q.clone(), q.clone())  # strides
    assert base != P.layout_key(q, q, q.clone())  # q is k
    assert base != P.layout_key(q.half(), q.clone(), q.clone())  # dtype


# Offline sm_90 (tests/codegen_stats.py's fake driver): kernels built, each launcher Triton 3.6's own descriptor
# expansion in front of a recorder (its C entry), the TMA fill a recorder of its arguments. Each method's reuse step
# runs through a LaunchPrograms (first call normal, second recorded, third and fourth replayed), then once more
# normally on the same tensors; the two launch sequences must match argument for argument at the C entry: the same
# inputs and constants (the metadata), the normal call's intermediates mapped one to one onto the replay's, the
# descriptors filled with the same fields at mapped addresses, every other value equal.
_CODE = r"""
import collections, torch
from triton.runtime import driver
import codegen_stats as cs
driver.set_active(cs._FakeDriver())
from triton import knobs
from triton.runtime.jit import JITFunction
from triton.compiler.compiler import CompiledKernel
from triton.backends.nvidia.driver import wrap_handle_tensordesc
knobs.runtime.launch_enter_hook = knobs.HookChain()
CompiledKernel.launch_metadata = lambda self, *a: None  # no loaded module offline

class TensorMap:  # what the fake fill_tma_descriptor returns: its arguments, the base address first
    def __init__(self, ptr, *rest):
        self.ptr, self.rest = ptr, tuple(tuple(x) if isinstance(x, list) else x for x in rest)

class Utils:
    fill_tma_descriptor = staticmethod(TensorMap)
driver.active.utils = Utils()
seen = []

class Launcher:  # Triton 3.6's CudaLauncher, its C entry replaced by a recorder of the expanded arguments
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False
    def __init__(self, kernel):
        self.launch = wrap_handle_tensordesc(self.entry, kernel.src.signature,
                                             getattr(kernel.metadata, "tensordesc_meta", None))
    def entry(self, *args):
        seen.append(args)
        if args[11] is not None:
            args[11](args[10])  # Triton's enter hook, as the C entry calls it
    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)

orig = JITFunction.run
def run(self, *a, grid, warmup, **kw):
    k = orig(self, *a, grid=grid, warmup=True, **kw)
    if k._run is None:
        k._run = Launcher(k)
    return orig(self, *a, grid=grid, warmup=False, **kw)
run.__wrapped__ = orig  # Triton's launch path, as kernels/launch.py reads it
JITFunction.run = run
from vc_compile.kernels import dispatch
dispatch._on_sm90 = lambda device: True  # CPU tensors stand for an sm_90 GPU's
from vc_compile import VCConfig
from vc_compile.methods import Phase, vsmooth as VS
from vc_compile.kernels.programs import LaunchPrograms
T = dispatch.Impl.TRITON
B, H, S, D = 1, 2, 1000, 128
q, k, v = (torch.randn(B, S, H, D, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
perm = torch.stack([torch.randperm(S) for _ in range(H)]).view(B, H, S)

def vs_fn(expcast):
    cfg = VCConfig(method="vsmooth", expcast=expcast)
    meta = VS.VSmoothMeta(perm=perm, centroids=torch.zeros(B, H, 4, D))
    return meta, lambda q, k, v: VS.run(q, k, v, phase=Phase.REUSE, meta=meta, cfg=cfg, sm_scale=0.1, impl=T)[0]

def ms_fn():
    sigma = torch.arange(S).repeat(B, H, 1)
    idx = torch.randint(0, S, (B, H, -(-S // 64), 192), dtype=torch.int32).sort(-1).values
    res = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    class Meta: pass
    def fn(q, k, v):
        return dispatch.sparse_attention(T, q, k, v, sigma, idx, sm_scale=0.1, group_size=64, residual=res,
                                         out_dtype=torch.bfloat16)
    return Meta(), fn

def norm(x):
    return None if isinstance(x, knobs.HookChain) and not x.calls else x

def compare(normal, replay, fixed):
    if len(normal) != len(replay):
        return f"{len(normal)} vs {len(replay)} launches"
    ptrs = {}
    def same_ptr(pa, pb):
        if pa in fixed:
            return pb == pa
        return ptrs.setdefault(pa, pb) == pb
    for n, r in zip(normal, replay):
        if n[:3] != r[:3] or n[4] is not r[4] or n[9] != r[9] or len(n) != len(r):
            return "grid, function, metadata or argument count differ"
        for i, (a, b) in enumerate(zip(n[13:], r[13:])):
            if isinstance(a, torch.Tensor):
                if not same_ptr(a.data_ptr(), b.data_ptr() if isinstance(b, torch.Tensor) else int(b)):
                    return f"arg {i}: a tensor's address"
            elif isinstance(a, TensorMap):
                if not isinstance(b, TensorMap) or a.rest != b.rest or not same_ptr(a.ptr, b.ptr):
                    return f"arg {i}: a TMA descriptor"
            elif norm(a) != norm(b) and not (a is None and b is None):
                return f"arg {i}: {a!r} != {b!r}"
    if len(set(ptrs.values())) != len(ptrs):
        return "two tensors at one place"
    return "same"

res = {}
for name, make in (("vsmooth", lambda: vs_fn(False)), ("expcast", lambda: vs_fn(True)), ("mcsparse", ms_fn)):
    meta, fn = make()
    progs = LaunchPrograms()
    for _ in range(3):  # as the op calls it: None -> the call runs normally
        if progs.run(("site",), meta, fn, q, k, v, collections.Counter()) is None:
            fn(q, k, v)
    seen.clear()
    out_r = progs.run(("site",), meta, fn, q, k, v, collections.Counter())
    replay = list(seen)
    seen.clear()
    out_n = fn(q, k, v)
    normal = list(seen)
    fixed = {t.data_ptr() for t in (q, k, v, perm)}
    fixed |= {t.data_ptr() for prog in progs.programs() for t in prog.consts}
    why = next(iter(progs.failures(meta).values()), None)
    res[name] = (progs.recorded, progs.replays, len(replay), why or compare(normal, replay, fixed),
                 out_r is not None and tuple(out_r.shape) == tuple(out_n.shape) and out_r.dtype == out_n.dtype)
print("RESULT", sorted(res.items()))
"""


def _c_entry_of_36() -> bool:
    """Whether the installed Triton's CUDA launcher is 3.6's (a compiled entry per kernel, which the harness
    fakes); 3.7+ have one generic entry and the programs call the launcher object instead."""
    import inspect

    from triton.backends.nvidia.driver import CudaLauncher
    return "kernel_metadata" not in inspect.signature(CudaLauncher.__call__).parameters


offline_36 = pytest.mark.skipif(not _c_entry_of_36(), reason=(
    "the offline harness fakes Triton 3.6's per-kernel launcher entry; on 3.7+ a program calls the launcher "
    "object, checked on the GPU by test_gpu_recorded_reuse_steps_give_the_normal_paths_bits"))


@offline_36
def test_a_replayed_program_hands_the_launchers_what_the_normal_path_does():
    line, why = result_line(_CODE)
    # per method: 1 program recorded, 2 replays (the third and fourth calls), launches per replay (V-Smooth: the
    # two preprocessing passes and the attention kernel; MC-Sparse: the gather kernel), the comparison
    assert line == ("RESULT [('expcast', (1, 2, 3, 'same', True)), ('mcsparse', (1, 2, 1, 'same', True)), "
                    "('vsmooth', (1, 2, 3, 'same', True))]"), why


# The op itself offline (same harness; the CPU tensors stand for an sm_90 GPU's and programs are allowed on them):
# a 20-step V-Smooth + ExpCast generation grouping every 10th step groups at steps 0 and 10; after each grouping the first reuse call runs
# normally, the second is recorded, the rest replay, from the third on through the site's lane; the report counts
# every call once.
_OP_CODE = _CODE.split("def vs_fn")[0] + r"""
from vc_compile.kernels import programs as P
P.LaunchPrograms.usable = staticmethod(lambda q: True)
dispatch.choose = lambda method, kernels, fp8, device: (T, "triton")  # the kernels, not the CPU reference
import vc_compile
from vc_compile.ops import PROGRAMS, _LANES
cfg = VCConfig.from_options({"method": "vsmooth", "expcast": True, "speed_gate": "off", "num_steps": 20,
                             "min_seq_len": 16, "group_interval": 10}).to_json()
with vc_compile.sampling(num_steps=20):
    for i in range(20):
        vc_compile.step(i)
        torch.ops.vcattn.attention(q, k, v, None, 4242, cfg, None)
rec = next(s for s in vc_compile.report().sites if s.site == 4242)
print("RESULT", PROGRAMS.recorded, PROGRAMS.replays, any(key[0] == 4242 for key in _LANES), rec.calls,
      dict(rec.phases), sum(rec.kernel_path.values()), rec.program_failure, dict(rec.runtime_fallbacks))
"""


@offline_36
def test_the_op_replays_through_programs_and_lanes_offline():
    line, why = result_line(_OP_CODE)
    # 2 recordings (one per grouping's metadata), 7 + 7 replays (steps 3-9, 13-19), a lane, 20 calls counted
    assert line == "RESULT 2 14 True 20 {'group': 2, 'reuse': 18} 20 None {}", why


@requires_cuda
@pytest.mark.parametrize("opts", [{"method": "vsmooth"}, {"method": "vsmooth", "expcast": True},
                                  {"method": "mcsparse", "density": 0.15, "warmup_steps": 1}],
                         ids=["vsmooth", "expcast", "mcsparse"])
def test_gpu_recorded_reuse_steps_give_the_normal_paths_bits(opts):
    """On the GPU: a generation's reuse steps replayed from a recorded program give the same bits as the op's
    normal path (programs off with the remembered launches), step for step, and the replays did happen, the later
    ones through the site's lane (its decisions kept, ops._Lane)."""
    import vc_compile
    from vc_compile.ops import PROGRAMS
    from vc_compile.kernels.launch import FAST_LAUNCH

    B, H, S, D = 1, 4, 3000, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    steps = [tuple(torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                   for _ in range(3)) for _ in range(14)]
    cfg = vc_compile.VCConfig.from_options(dict(opts, cuda_graphs="off", speed_gate="off")).to_json()

    def generation(site):
        outs = []
        with vc_compile.sampling(num_steps=len(steps)):
            for i, (q, k, v) in enumerate(steps):
                vc_compile.step(i)
                outs.append(torch.ops.vcattn.attention(q, k, v, None, site, cfg, None))
        torch.cuda.synchronize()
        return outs
    before = PROGRAMS.replays
    got = generation(9101)
    assert PROGRAMS.replays > before
    assert "replays of recorded reuse steps" in str(vc_compile.report())
    from vc_compile.ops import _LANES
    assert any(key[0] == 9101 for key in _LANES)
    FAST_LAUNCH.enabled = False
    try:
        replays = PROGRAMS.replays
        want = generation(9102)
        assert PROGRAMS.replays == replays  # off with the remembered launches
    finally:
        FAST_LAUNCH.enabled = True
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}"
