"""The ``callback_on_step_end`` step signal (runtime/pipeline_calls.py) on fake pipelines: no diffusers needed.

The model asks the tracker what ``vcattn::attention`` would (``TRACKER.current``), so the step, branch,
generation and source each call gets are checked directly.
"""
import pytest
import torch

import vc_compile
from vc_compile.runtime import pipeline_calls
from vc_compile.runtime.steps import TRACKER

SHAPE = ((1, 2, 256, 64), (1, 2, 256, 64))


@pytest.fixture(autouse=True)
def _fresh():
    vc_compile.reset(report=True)
    yield
    vc_compile.reset(report=True)


class Scheduler:
    timesteps = None


class Pipe:
    """A diffusers-shaped loop whose variables the frame probe could not read (``k``, not ``i``)."""

    def __init__(self, cfg_calls=2):
        self.scheduler, self.cfg_calls, self.seen = Scheduler(), cfg_calls, []

    @property
    def num_timesteps(self):
        return self._num_timesteps

    def __call__(self, num_inference_steps=4, segments=1, callback_on_step_end=None,
                 callback_on_step_end_tensor_inputs=("latents",)):
        latents = torch.zeros(1)
        for _ in range(segments):
            ts = torch.linspace(999, 1, num_inference_steps)
            self.scheduler.timesteps = ts
            self._num_timesteps = len(ts)
            for k, t in enumerate(ts):
                for _ in range(self.cfg_calls):
                    self.seen.append(TRACKER.current((1, 0), 50, shape=SHAPE))
                if callback_on_step_end is not None:
                    out = callback_on_step_end(self, k, t, {"latents": latents})
                    latents = out.pop("latents", latents)
        return latents


class PositionalPipe(Pipe):
    def __call__(self, num_inference_steps=4, callback_on_step_end=None):  # positional use below
        return super().__call__(num_inference_steps, 1, callback_on_step_end)


def steps(seen):
    return [(s.step, s.branch, s.num_steps, s.source) for s in seen]


def test_steps_branches_generations_from_the_callback():
    pipe = Pipe()
    assert pipeline_calls.track(pipe) and pipeline_calls.is_tracked(pipe)
    assert isinstance(pipe, Pipe) and type(pipe) is not Pipe and type(pipe).__name__ == "Pipe"
    g0 = TRACKER.generation
    pipe(num_inference_steps=3)
    assert steps(pipe.seen) == [(i, b, 3, "callback") for i in range(3) for b in (0, 1)]
    assert {s.generation for s in pipe.seen} == {g0 + 1}
    pipe.seen.clear()
    pipe(num_inference_steps=2)  # the next call: a new generation from step 0
    assert steps(pipe.seen) == [(i, b, 2, "callback") for i in range(2) for b in (0, 1)]
    assert pipe.seen[0].generation > g0 + 1 and not TRACKER.calls
    pipeline_calls.untrack(pipe)
    assert type(pipe) is Pipe


def test_segment_loops_restart_the_schedule():
    pipe = Pipe(cfg_calls=1)
    pipeline_calls.track(pipe)
    pipe(num_inference_steps=2, segments=3)
    assert [(s.step, s.source) for s in pipe.seen] == [(0, "callback"), (1, "callback")] * 3
    gens = [s.generation for s in pipe.seen]
    assert gens[0] == gens[1] < gens[2] == gens[3] < gens[4] == gens[5]


def test_user_callback_runs_first_and_keeps_its_result():
    pipe = Pipe(cfg_calls=1)
    pipeline_calls.track(pipe)
    log = []

    def cb(p, i, t, kw):
        log.append((i, TRACKER.calls[-1].step))  # the tracker has not advanced yet
        return {"latents": kw["latents"] + 1}

    assert pipe(num_inference_steps=3, callback_on_step_end=cb).item() == 3
    assert log == [(0, 0), (1, 1), (2, 2)]


def test_positional_callback_is_chained():
    pipe = PositionalPipe(cfg_calls=1)
    pipeline_calls.track(pipe)
    hits = []
    pipe(3, lambda p, i, t, kw: hits.append(i) or kw)
    assert hits == [0, 1, 2] and [s.step for s in pipe.seen] == [0, 1, 2]


def test_explicit_api_still_wins_inside_a_tracked_call():
    pipe = Pipe(cfg_calls=1)
    pipeline_calls.track(pipe)

    def cb(p, i, t, kw):
        vc_compile.step(7, num_steps=9)
        return kw

    pipe(num_inference_steps=3, callback_on_step_end=cb)
    assert [(s.step, s.source) for s in pipe.seen] == [(0, "callback"), (7, "explicit"), (7, "explicit")]


def test_diffusers_callback_helper_is_a_no_op_when_tracked():
    pipe = Pipe(cfg_calls=1)
    pipeline_calls.track(pipe)
    pipe(num_inference_steps=3, callback_on_step_end=vc_compile.diffusers_callback)
    assert [(s.step, s.source) for s in pipe.seen] == [(i, "callback") for i in range(3)]


def test_a_pipeline_without_callback_parameter_is_left_to_the_frame_probe():
    class Old:
        def __call__(self, num_inference_steps=2):
            return None

    old = Old()
    assert not pipeline_calls.track(old) and type(old) is Old


def test_exception_in_the_loop_closes_the_call():
    pipe = Pipe(cfg_calls=1)
    pipeline_calls.track(pipe)

    def boom(p, i, t, kw):
        raise RuntimeError("user callback failed")

    with pytest.raises(RuntimeError, match="user callback failed"):
        pipe(num_inference_steps=2, callback_on_step_end=boom)
    assert not TRACKER.calls and TRACKER.pending_generation
