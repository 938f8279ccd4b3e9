"""Step and block caches (cache-dit's DBCache, FBCache, ...) skip some blocks' calls on some steps. MC-Sparse keeps
a selection per block: a block whose call was skipped on an anchor step must select at its next call, not reuse
the previous anchor's selection to the end of the schedule; step indices must still follow the pipeline.

The op-level test needs nothing but the package (CPU, reference kernels); the cache-dit one runs where cache-dit
is installed (a tiny diffusers WanPipeline, DBCache with a fixed per-step computation mask)."""
import functools

import pytest
import torch

import vc_compile
import vc_compile.ops  # noqa: F401  (registers vcattn::attention)
from vc_compile.config import VCConfig
from vc_compile.methods import mcsparse
from vc_compile.runtime import report as _report

pytestmark = pytest.mark.usefixtures("fresh_vcattn")
OPTS = {"method": "mcsparse", "density": 0.5, "min_seq_len": 64, "kmeans_iters": 1,
        "experimental": {"kmeans_init_iters": 2}}


def test_schedule_epochs():
    cfg = VCConfig.from_options(OPTS)
    assert mcsparse.anchor_steps(cfg, 10) == (2, 5)
    assert [mcsparse.anchor_epoch(cfg, s, 10) for s in range(10)] == [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1]


def test_a_block_that_missed_an_anchor_step_selects_at_its_next_call():
    """Two blocks share one site (one graph), told apart by their weights. Block B is skipped on both anchor steps
    (2 and 5 of 10; warm-up 0-1): it selects at its first call after the warm-up (step 3, no selection yet) and
    again at step 6 (it missed step 5's), reusing in between; block A follows the schedule."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 192, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    wa, wb = torch.randn(4, 4), torch.randn(4, 4)
    cfg = VCConfig.from_options(OPTS).to_json()
    n, site, phases = 10, 7001, {"a": [], "b": []}

    def call(ident, who):
        before = dict(_report.site(site).phases)
        torch.ops.vcattn.attention(q, k, v, ident, site, cfg, None)
        after = _report.site(site).phases
        phases[who] += [p for p in after if after[p] != before.get(p, 0)]
    with vc_compile.sampling(num_steps=n):
        for i in range(n):
            vc_compile.step(i)
            call(wa, "a")
            if i not in (2, 5):
                call(wb, "b")
    assert phases["a"] == ["warmup"] * 2 + ["anchor", "reuse", "reuse", "anchor"] + ["reuse"] * 4
    assert phases["b"] == ["warmup"] * 2 + ["anchor", "reuse", "anchor"] + ["reuse"] * 3


def test_a_pipeline_class_patched_after_a_first_enable_keeps_its_patch():
    """cache-dit wraps the pipeline class's ``__call__`` (its cache context). A pipeline tracked after that, in a
    process where another pipeline of the class was tracked before the patch, must still run the patched call
    (it did not: the tracked subclass had kept the class's first ``__call__``, so cache-dit's context was skipped
    and its step mask applied one forward late)."""
    from vc_compile.runtime import pipeline_calls

    class Pipe:
        def __call__(self, steps=2, callback_on_step_end=None):
            for i in range(steps):
                callback_on_step_end(self, i, None, {})
            return "ran"

    seen = []
    first, second = Pipe(), Pipe()
    assert pipeline_calls.track(first) and first() == "ran"
    original = Pipe.__call__

    @functools.wraps(original)
    def patched(self, *args, **kwargs):  # what cache-dit does to the class, after the first pipeline
        seen.append(self)
        return original(self, *args, **kwargs)
    Pipe.__call__ = patched
    assert pipeline_calls.track(second) and second() == "ran" and first() == "ran"
    assert seen == [second, first]
    assert type(second) is type(first) and isinstance(second, Pipe)
    pipeline_calls.untrack(first)
    pipeline_calls.untrack(second)
    assert type(first) is Pipe and Pipe.__call__ is patched


def test_cache_dit_block_cache_keeps_steps_and_selections_right():
    """cache-dit's DBCache on a 4-block tiny WanPipeline, first and last block always computed, the two middle
    ones cached on the steps the mask marks 0 (2, 5, 6: both anchor steps among them): every call's step comes from
    the pipeline's callback, the calls are exactly the computed ones, and the middle blocks select at their first
    call after each anchor step they missed (steps 3 and 7)."""
    cache_dit = pytest.importorskip("cache_dit")
    from test_pipeline import OPTS as PIPE_OPTS
    from test_pipeline import relerr, run, wan
    pipe, call = wan(layers=4)
    steps, mask = 10, [1, 1, 0, 1, 1, 0, 0, 1, 1, 1]
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=0, steps_computation_mask=mask,
        steps_computation_policy="static", residual_diff_threshold=1e6, num_inference_steps=steps))
    cached = run(pipe, call, steps)
    vc_compile.enable(pipe, method="mcsparse", density=0.5, **PIPE_OPTS)
    out = run(pipe, call, steps)
    (site,) = vc_compile.report().rewritten
    skipped = mask.count(0) * 2 * 2  # steps x CFG x middle blocks
    assert site.calls == steps * 2 * 4 - skipped == 68
    assert site.step_sources == {"callback": 68}
    # warm-up 0-1 (16 calls); anchors: outer blocks at 2 and 5 (8), middle blocks at 3 and 7 (8); the rest reuse
    assert site.phases == {"warmup": 16, "anchor": 16, "reuse": 36}, site.phases
    assert relerr(out, cached) < 0.05
