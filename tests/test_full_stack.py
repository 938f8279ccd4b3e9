"""vcattn inside the stack users run around it: torchao float8 linear layers in the same compile.

A tiny random-weight WanPipeline (tests/test_pipeline.py's), its block linears quantised with torchao's
``Float8DynamicActivationFloat8WeightConfig`` (dynamic FP8 activations and weights, per-row scales), then
``vc_compile.enable``: one graph for both blocks, no graph break, no recompile on a second generation, every
self-attention call rewritten with a block identity, the float8 GEMMs (``aten::_scaled_mm``) running in the same
compiled blocks, and the output as close to the float8 model's eager output as the method alone is to the bf16
model's. (Step and block caches: tests/methods/test_block_skipping.py.)

torchao refuses float8 quantisation on a CPU (a hardware check for CUDA >= sm89), though its float8 linear runs
there (``torch._scaled_mm`` has a CPU kernel): the ``cpu_float8`` fixture lifts that check for these tests only."""
import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")
torchao = pytest.importorskip("torchao")

import vc_compile  # noqa: E402
from test_pipeline import OPTS, relerr, run, wan  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_vcattn")


@pytest.fixture
def cpu_float8(monkeypatch):
    import torchao.quantization.quant_api as qa
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(qa, "_check_hardware_support", lambda granularity: None)


def float8_blocks(module) -> int:
    """Quantise ``module``'s block linears as the pipeline benchmark's ``+f8lin`` variants do; how many."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    # set_inductor_config=False: the default changes Inductor settings for the whole process (other tests)
    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False),
              filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and name.startswith("blocks."))
    return sum(type(m.weight).__name__ == "Float8Tensor" for m in module.modules() if isinstance(m, torch.nn.Linear))


def scaled_mm_calls(fn) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_float8_linears_and_vsmooth_expcast_in_one_compile(cpu_float8, compiler):
    pipe, call = wan()
    ref = run(pipe, call, 4)
    plain = wan()[0].transformer  # the same seeded weights, bf16: the method alone on it
    assert float8_blocks(pipe.transformer) == 2 * 10  # q, k, v, o of two attentions + 2 FFN linears, 2 blocks
    f8 = run(pipe, call, 4)
    assert 0 < relerr(f8, ref) < 0.05  # float8 linears change the output a little, as they should

    opts = {**OPTS, "experimental": {**OPTS["experimental"], "compiler": compiler}}
    vc_compile.enable(pipe, method="vsmooth", expcast=True, **opts)
    out = run(pipe, call, 4)
    (site,) = vc_compile.report().rewritten  # one block graph serves both blocks
    assert site.has_identity and site.calls == 4 * 2 * 2  # steps x CFG x blocks: every self-attention call
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    frames = counters["stats"]["calls_captured"]
    calls = scaled_mm_calls(lambda: run(pipe, call, 3))  # a second generation: no new graph, float8 GEMMs ran
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] == frames
    assert calls == 3 * 2 * 2 * 10

    # the stack's error against the float8 model ~ the method's own error against the bf16 model
    pipe.transformer = plain
    vc_compile.enable(pipe, method="vsmooth", expcast=True, **OPTS)
    alone = relerr(run(pipe, call, 4), ref)
    assert relerr(out, f8) < 2 * alone + 1e-3, (relerr(out, f8), alone)


def test_float8_linears_keep_mcsparse_blocks_apart(cpu_float8):
    """The block identity of a float8 block is its q-projection's quantised data: the two blocks keep their own
    selections (a shared one would show as one block anchoring and the other reusing its metadata)."""
    pipe, call = wan()
    float8_blocks(pipe.transformer)
    vc_compile.enable(pipe, method="mcsparse", density=0.5, **OPTS)
    run(pipe, call, 6)
    (site,) = vc_compile.report().rewritten
    # 6 steps: warm-up step 0, anchors 1 and 3, reuse 2, 4, 5; x CFG x 2 blocks, each block on its own metadata
    assert site.phases == {"warmup": 4, "anchor": 8, "reuse": 12}, site.phases
    assert len({k[1] for k in vc_compile.runtime.state.keys()}) == 2  # two blocks' metadata
