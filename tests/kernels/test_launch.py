"""The remembered launch (kernels/launch.py): a later launch hands the compiled kernel's launcher exactly the
arguments Triton's binder would have handed it, for the real kernels; it steps aside where it cannot be sure."""
from conftest import requires_cuda
from offline_sm90 import result_line

# Offline sm_90 (tests/codegen_stats.py's fake driver, no launch): each kernel is compiled once, its launcher is
# replaced by a recorder, and every call of the preprocessing, the attention kernel and the gather kernel runs
# twice on the same tensors: through the binder (FAST_LAUNCH off) and through the remembered launch.
_CODE = r"""
import torch
from triton.runtime import driver
import codegen_stats as cs
driver.set_active(cs._FakeDriver())
from triton.runtime.jit import JITFunction
from vc_compile.kernels import preprocess as tpre, vsmooth_attn_sm90 as tv, sparse_attn_sm90 as tsp
from vc_compile.kernels.configs import vsmooth_sm90_default
from vc_compile.kernels.launch import FAST_LAUNCH
from triton import knobs
knobs.runtime.launch_enter_hook = None  # the binder's path would build launch metadata (a loaded kernel) for a chain

seen = []
orig = JITFunction.run
def run(self, *a, grid, warmup, **kw):  # build (never launch), then record what the launcher is handed
    k = orig(self, *a, grid=grid, warmup=True, **kw)
    if k._run is None:
        k._run = lambda *args: seen.append(args)
    return orig(self, *a, grid=grid, warmup=False, **kw)
run.__wrapped__ = orig  # Triton's launch path, as kernels/launch.py reads it
JITFunction.run = run

INPUTS = set()  # ids of the tensors a call is given: handed over as themselves; the call's own allocations differ
               # between calls, so those are compared by layout

def norm(x):  # Triton 3.6's default launch hooks are empty chains; the remembered launch hands over None
    return None if isinstance(x, knobs.HookChain) and not x.calls else x

def same(a, b):
    def eq(x, y):
        x, y = norm(x), norm(y)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if id(x) in INPUTS or id(y) in INPUTS:
                return x is y
            return (x.shape, x.stride(), x.dtype, x.data_ptr() % 16) == (y.shape, y.stride(), y.dtype, y.data_ptr() % 16)
        if hasattr(x, "block_shape") and type(x) is type(y):  # a TMA descriptor: its tensor, then the rest
            return eq(x.base, y.base) and all(getattr(x, f) == getattr(y, f)
                                              for f in ("shape", "strides", "block_shape", "layout", "padding"))
        return type(x) is type(y) and x == y
    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))

def both(call):
    out = []
    for fast in (False, True, True):
        FAST_LAUNCH.enabled = fast
        seen.clear()
        call()
        out.append(list(seen))
    return out

B, H, S, D = 1, 2, 1000, 128
q = torch.randn(B, S, H, D, dtype=torch.bfloat16).permute(0, 2, 1, 3)
perm = torch.stack([torch.randperm(S) for _ in range(H)]).view(B, H, S)
INPUTS.update({id(q), id(perm)})
res = {}
slow, warm, fast = both(lambda: tpre.preprocess(q, q, q, perm, sm_scale=0.1, qk_format="int8", v_layout="sm90"))
res["preprocess"] = (len(slow), all(same(a, b) for a, b in zip(slow, fast)))
qk, vq = tpre.preprocess(q, q, q, perm, sm_scale=0.1, qk_format="int8", v_layout="sm90")
INPUTS.update(id(t) for t in list(qk) + list(vq) if isinstance(t, torch.Tensor))
cfg = vsmooth_sm90_default(128, True, 32760)  # the long-sequence ExpCast launch (warp-specialised)
slow, warm, fast = both(lambda: tv.vsmooth_attention_sm90(qk, vq, expcast=True, launch=cfg))
res["attention"] = (len(slow), all(same(a, b) for a, b in zip(slow, fast)))
G = -(-S // 64)
sigma = torch.arange(S).repeat(B, H, 1)
idx = torch.randint(0, S, (B, H, G, 160)).sort(-1).values
INPUTS.update({id(sigma), id(idx)})
slow, warm, fast = both(lambda: tsp.sparse_attention_sm90(q, q, q, sigma, idx, sm_scale=0.1, group_size=64))
res["gather"] = (len(slow), all(same(a, b) for a, b in zip(slow, fast)))
print("RESULT", sorted(res.items()), "fast", FAST_LAUNCH.fast)
"""


def test_a_remembered_launch_hands_the_launcher_what_the_binder_does():
    line, why = result_line(_CODE)
    # 2 launches of the preprocessing, 1 of each attention kernel, each handed the same arguments, object for
    # object; remembered launches: 4 in the third runs, 2 in the preprocessing between
    assert line == ("RESULT [('attention', (1, True)), ('gather', (1, True)), ('preprocess', (2, True))] "
                    "fast 6"), why


def test_the_remembered_launch_steps_aside_where_it_cannot_be_sure(monkeypatch):
    """Under the interpreter, with a launch hook, or with a pre-run hook, every launch takes the binder."""
    import triton

    from vc_compile.kernels import launch as L

    fl = L.FastLaunch()

    class Fn:
        pre_run_hooks = []
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_CONVENTION_ERROR", None)
    assert fl.usable(Fn())
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert not fl.usable(Fn())
    chain = triton.knobs.HookChain()
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    assert fl.usable(Fn())  # triton 3.6's default: an empty chain
    chain.add(lambda *a: None)
    assert not fl.usable(Fn())
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    Fn.pre_run_hooks = [lambda *a, **k: None]
    assert not fl.usable(Fn())
    Fn.pre_run_hooks = []
    monkeypatch.setattr(L, "interpreting", lambda: True)
    assert not fl.usable(Fn())
    fl.enabled, _ = False, monkeypatch.setattr(L, "interpreting", lambda: False)
    assert not fl.usable(Fn())


@requires_cuda
def test_gpu_remembered_launches_give_the_same_bits():
    """On the GPU: a V-Smooth + ExpCast call and a gather call, each through the binder and then remembered, give
    the same bits, and the later calls did skip the binder."""
    import torch

    from vc_compile.kernels import dispatch
    from vc_compile.kernels import sparse_attn_sm90 as tsp
    from vc_compile.kernels.launch import FAST_LAUNCH

    T = dispatch.Impl.TRITON
    B, H, S, D = 1, 3, 4173, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(3))
    perm = torch.stack([torch.randperm(S, device="cuda") for _ in range(H)]).view(B, H, S)

    def op():
        qk, vq = dispatch.preprocess(T, q, k, v, perm, sm_scale=D ** -0.5, expcast=True)
        return dispatch.vsmooth_attention(T, qk, vq, expcast=True)
    G = -(-S // 64)
    sigma = torch.stack([torch.randperm(S, device="cuda") for _ in range(H)]).view(B, H, S)
    idx = torch.randint(0, S, (B, H, G, 640), device="cuda").sort(-1).values

    def gather():
        return tsp.sparse_attention_sm90(q, k, v, sigma, idx, sm_scale=D ** -0.5, group_size=64)
    FAST_LAUNCH.enabled = False
    try:
        want = (op(), gather())
    finally:
        FAST_LAUNCH.enabled = True
    before = FAST_LAUNCH.fast
    op(), gather()  # remembered here (a first launch per key takes the binder)
    got = (op(), gather())
    torch.cuda.synchronize()
    assert FAST_LAUNCH.fast - before >= 4
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_report_says_how_kernels_were_launched(monkeypatch):
    """``report()`` counts remembered launches and launches through the binder, and says why none is remembered
    where the path is off (here: the CPU interpreter, or a Triton other than 3.6)."""
    import vc_compile
    from vc_compile.kernels import launch as L

    fl = L.FastLaunch()
    monkeypatch.setattr(L, "FAST_LAUNCH", fl)
    assert vc_compile.report().launches is None  # nothing launched yet
    fl.fast, fl.slow = 7, 2
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_CONVENTION_ERROR", None)
    line = vc_compile.report().launches
    assert line == "kernel launches: 7 remembered (Triton's binder skipped), 2 through the binder"
    assert vc_compile.report().to_dict()["launches"] == line
    monkeypatch.setattr(L, "_CONVENTION_ERROR", "Triton 9.9's JITFunction.run does not launch as the remembered "
                                                "launches replay (a new calling convention)")
    assert "a new calling convention" in vc_compile.report().launches
    monkeypatch.setattr(L, "interpreting", lambda: True)
    monkeypatch.setattr(L, "_CONVENTION_ERROR", None)
    assert vc_compile.report().launches.endswith("remembered launches off: the CPU interpreter runs the kernels")


def test_a_launch_that_is_not_a_jit_functions_is_never_remembered(monkeypatch):
    """A launch object without Triton's per-device caches (an autotuner, a wrapper), or one that hands back no
    compiled kernel, goes through its own path every time: nothing is remembered, nothing fails."""
    import types

    from vc_compile.kernels import launch as L

    fl = L.FastLaunch()
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_CONVENTION_ERROR", None)
    monkeypatch.setattr(L, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda d: 0)))
    calls = []

    class Wrapper:
        pre_run_hooks = []

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k)) or "not a compiled kernel"
    w = Wrapper()
    for _ in range(3):
        assert fl(w, (4, 2), ("key",), 1, 2, X=3) == "not a compiled kernel"
    assert len(calls) == 3 and calls[0] == ((4, 2), (1, 2), {"X": 3}) and (fl.fast, fl.slow) == (0, 3)
    assert not fl._memo
