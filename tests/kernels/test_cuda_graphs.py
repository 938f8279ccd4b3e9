"""Reuse steps replayed as CUDA graphs (``cuda_graphs``, kernels/graphs.py): same bits as launching from Python,
outputs never overwritten by a later replay, a graph per metadata object, refused where it cannot be right.

CPU: the option, the methods' replayable rules, and that nothing is captured off a GPU. GPU: the op itself."""
import pytest
import torch

import vc_compile
import vc_compile.ops  # noqa: F401
from conftest import requires_cuda
from test_vsmooth_attn import make_qkv
from vc_compile.config import CudaGraphs, VCConfig
from vc_compile.methods import Phase, mcsparse, vsmooth
from vc_compile.ops import GRAPHS
from vc_compile.kernels.graphs import AUTO_MAX_WORK, LaunchGraphs


def test_option_is_an_enum_with_a_clear_error():
    assert VCConfig().cuda_graphs == CudaGraphs.OFF  # the recorded launch sequences (kernels/programs.py)
    assert VCConfig.from_options({"cuda_graphs": "off"}).cuda_graphs == CudaGraphs.OFF
    with pytest.raises(ValueError, match="cuda_graphs"):
        VCConfig.from_options({"cuda_graphs": "sometimes"})


def test_replayable_rules():
    cfg = VCConfig()
    assert vsmooth.replayable(Phase.REUSE, cfg)
    assert not vsmooth.replayable(Phase.GROUP, cfg)  # k-means updates the metadata
    assert mcsparse.replayable(Phase.REUSE, VCConfig(method="mcsparse"))
    assert not mcsparse.replayable(Phase.ANCHOR, VCConfig(method="mcsparse"))
    # the guard reads errors back to the host; the flags pass is opt-in: launched from Python
    assert not mcsparse.replayable(Phase.REUSE, VCConfig.from_options({"method": "mcsparse", "guard_threshold": 0.1}))
    assert not mcsparse.replayable(Phase.REUSE, VCConfig.from_options({"method": "mcsparse",
                                                                       "propagate_nonfinite": True}))


def test_no_graph_off_a_gpu_and_auto_bound():
    q = torch.zeros(1, 2, 64, 64)
    assert not LaunchGraphs.wanted("on", q, q)
    # the AUTO bound: 12 heads x 8192 tokens x D 128 is in, 12 x 16384 is out (the NOTE's measurement)
    assert 12 * 8192 * 8192 * 128 <= AUTO_MAX_WORK < 12 * 16384 * 16384 * 128


def _run_loop(opts, qkv_steps, site):
    cfg = VCConfig.from_options(opts).to_json()
    outs = []
    with vc_compile.sampling(num_steps=len(qkv_steps)):
        for i, (q, k, v) in enumerate(qkv_steps):
            vc_compile.step(i)
            outs.append(torch.ops.vcattn.attention(q, k, v, None, site, cfg, None))
    return outs


@requires_cuda
@pytest.mark.parametrize("method", ["vsmooth", "vsmooth+expcast", "mcsparse"])
def test_gpu_graph_replay_matches_python_launches_bit_for_bit(method):
    """The same kernels on the same data: replayed reuse steps equal the launched ones exactly, and an output
    kept from an earlier step is not overwritten by later replays."""
    vc_compile.reset(report=True)
    opts = {"method": "mcsparse" if method == "mcsparse" else "vsmooth", "expcast": method.endswith("expcast"),
            "num_steps": 12, "max_logit_std": 0}
    if method == "mcsparse":
        opts.update(warmup_steps=2, anchor_steps=[2])
    else:
        opts.update(group_fraction=0.1)
    steps = [make_qkv(1, 4, 2048, 128, torch.bfloat16, device="cuda", seed=s) for s in range(12)]
    ref = _run_loop(dict(opts, cuda_graphs="off"), steps, site=991_001)
    vc_compile.reset()
    captures = GRAPHS.captures
    got = _run_loop(dict(opts, cuda_graphs="on"), steps, site=991_002)
    kept = [o.clone() for o in got]
    rec = next(s for s in vc_compile.report().sites if s.site == 991_002)
    assert rec.cuda_graph_failure is None
    assert any(p.endswith("+cuda_graph") for p in rec.kernel_path), rec.kernel_path
    assert GRAPHS.captures == captures + 1  # one metadata object, one graph
    for a, b, c in zip(ref, got, kept):
        assert torch.equal(a, b) and torch.equal(b, c)


@requires_cuda
def test_gpu_new_metadata_new_graph():
    """A regrouping or a new generation replaces the metadata: its graph is captured again, never replayed
    with the old one's buffers."""
    vc_compile.reset(report=True)
    opts = {"method": "vsmooth", "num_steps": 8, "group_fraction": 0.1, "max_logit_std": 0, "cuda_graphs": "on"}
    steps = [make_qkv(1, 2, 2048, 128, torch.bfloat16, device="cuda", seed=s) for s in range(8)]
    c0 = GRAPHS.captures
    a = _run_loop(opts, steps, site=991_003)
    b = _run_loop(opts, steps, site=991_003)  # a new generation: new grouping, new graph
    assert GRAPHS.captures == c0 + 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@requires_cuda
@pytest.mark.parametrize("method", ["vsmooth", "mcsparse"])
def test_gpu_direct_graph_when_inputs_stay_put(method):
    """q, k, v written into the same buffers each step (as a compiled model's are): the graph is captured on
    them and replayed without a copy, bit for bit the launched result; a step whose inputs sit elsewhere
    replays a staged graph instead, also exact."""
    vc_compile.reset(report=True)
    opts = {"method": method, "num_steps": 12, "max_logit_std": 0}
    opts.update(warmup_steps=2, anchor_steps=[2]) if method == "mcsparse" else opts.update(group_fraction=0.1)
    steps = [make_qkv(1, 4, 2048, 128, torch.bfloat16, device="cuda", seed=s) for s in range(12)]
    ref = _run_loop(dict(opts, cuda_graphs="off"), steps, site=991_011)
    bufs = tuple(torch.empty_like(t) for t in steps[0])

    def in_place(i):
        if i == 9:  # one step elsewhere: the staged graph
            return steps[i]
        for b, t in zip(bufs, steps[i]):
            b.copy_(t)
        return bufs
    vc_compile.reset()
    direct0, replays0 = GRAPHS.direct_replays, GRAPHS.replays
    cfg = VCConfig.from_options(dict(opts, cuda_graphs="on")).to_json()
    got = []
    with vc_compile.sampling(num_steps=12):
        for i in range(12):
            vc_compile.step(i)
            got.append(torch.ops.vcattn.attention(*in_place(i), None, 991_012, cfg, None))
    rec = next(s for s in vc_compile.report().sites if s.site == 991_012)
    assert rec.cuda_graph_failure is None
    assert GRAPHS.replays - replays0 >= 3 and GRAPHS.direct_replays - direct0 == GRAPHS.replays - replays0 - 1
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
