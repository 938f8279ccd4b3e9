"""Kernel builds ahead of the first call: what a fresh process would otherwise wait for at its first generation.

Triton builds a kernel at its first launch, serially, on the launching thread: a fresh process pays every kernel
of its methods' phases inside the first generation (seconds to tens of seconds of start-up over stock
torch.compile; docs/design/cold-start.md). Our rewrite runs
before Inductor compiles the graph, and knows every rewritten call's shapes, strides, dtypes and options then.
So the backend hands them to helper processes that run those calls on random inputs of the same layout through
each method's phases, while the parent goes on compiling: the kernels land in Triton's on-disk cache (and the
tuning cache, where a launch configuration is tuned on first use), and the parent's first launch of each finds
them there. Nothing of the parent's computation changes: the same kernels, looked up by the same keys.

* ``requests_for_graph(gm)``: one request per distinct rewritten call (``vcattn::attention`` node) whose
  tensors have static shapes: config, scale, RoPE spec and each tensor's layout (``TensorSpec``).
* ``plan_chains(request)``: the steps a helper runs, split into independent chains that build in parallel
  (one process each): a method's warm-up phase (MC-Sparse's ``WARMUP``) apart from the rest, which starts
  from no metadata at its first step. Within a chain, the first two steps of every run of one phase (the
  second: a warm-started grouping, a CUDA-graph capture).
* ``Prebuilds`` (``runtime.Runtime.prebuilds``): the helper processes in flight. The op's first call of a
  phase waits for the helpers that build that phase (``wait``, at most ``WAIT_S``): their builds are further
  along than the parent's would be, and two processes building the same kernel only compete for the CPU; a
  later phase's helper goes on meanwhile (MC-Sparse's anchor kernels build during its warm-up steps). A helper
  that fails or times out changes nothing but the time: the parent builds its kernels itself; ``report()`` says
  what happened.
* ``Prebuilds.warm`` (called by ``vc_compile.enable``): helpers started before anything is traced, their
  interpreter and imports done by the time the rewrite hands them jobs; those left without one end then.
* Option ``prebuild`` ('auto' | 'on' | 'off'): 'auto' (the default) starts helpers where the calls run on a CUDA
  device with the Triton kernels; 'on' also on the CPU reference path (tests); 'off' starts none. A helper never
  starts helpers itself. A helper first finds every kernel its job launches (``discover``: the job run with
  launches turned away), builds them all at once (``build_parallel``), then runs the job, and leaves a marker in
  Triton's cache (``_marker_key``: the layouts, the kernel options, the phases): a later process whose request
  has a marker starts no helper, its kernels are on disk. ``python -m vc_compile warmup`` runs the same jobs
  ahead, for the usual layouts (``prebuild/warmup.py``).

What bounds a helper: its imports (~5-9 s under Inductor's load) and the longest single build (the
warp-specialised Gluon kernel, ~6 s); the measurements are in docs/design/cold-start.md.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..runtime import report as _report
from ..runtime.runtime import current, provide

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vc_compile/
ENV_CHILD = "VCATTN_PREBUILD_CHILD"  # set in a helper: it never starts helpers itself
WAIT_S = 180.0  # the op's first call waits at most this long for the helpers, then kills them and goes on
IDLE_S = 900.0  # a helper started ahead (``Prebuilds.warm``) exits after this long without a job
_ARGS = ("q", "k", "v", "ident", "site", "config", "scale", "cos", "sin", "rope")
_TENSORS = ("q", "k", "v", "ident", "cos", "sin")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout (what Triton's specialisation sees: dtype, strides, alignment of a fresh storage)."""
    shape: tuple
    stride: tuple
    dtype: str
    device: str
    offset: int = 0

    @classmethod
    def of(cls, t) -> Optional["TensorSpec"]:
        """The spec of a (fake) tensor, or None where a size or stride is symbolic (dynamic shapes: the run-time
        value is unknown at compile time)."""
        try:
            # symbolic sizes are left alone: int() of a SymInt would specialise the graph on its value (a guard,
            # then a recompile at every new length)
            if any(type(s) is not int for s in (*t.shape, *t.stride(), t.storage_offset())):
                return None
            shape = tuple(int(s) for s in t.shape)
            stride = tuple(int(s) for s in t.stride())
            offset = int(t.storage_offset())
        except (TypeError, ValueError, RuntimeError):
            return None
        return cls(shape, stride, str(t.dtype).replace("torch.", ""), str(t.device), offset)

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(**{**d, "shape": tuple(d["shape"]), "stride": tuple(d["stride"])})

    def make(self, gen):
        """Random values in this layout (one storage of the span the strides reach)."""
        import torch

        dtype = getattr(torch, self.dtype)
        span = self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        if dtype.is_floating_point:
            base = torch.randn(span, generator=gen, dtype=torch.float32, device=self.device).to(dtype)
        else:
            base = torch.zeros(span, dtype=dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset)


def _key(req: dict) -> str:
    """A request's identity: everything but its site id (calls of one layout and options are one request)."""
    return json.dumps({k: v for k, v in req.items() if k != "site"}, sort_keys=True)


def _call_args(node) -> Dict[str, object]:
    args = dict(zip(_ARGS, node.args))
    args.update({k: v for k, v in node.kwargs.items() if k in _ARGS})
    return args


def requests_for_graph(gm) -> List[dict]:
    """One JSON-able request per distinct ``vcattn::attention`` call of the graph (and its submodules) whose
    tensors have static layouts; calls that differ only in their site id are one request."""
    import torch
    import torch.fx as fx

    from ..passes.fx_nodes import val

    target = torch.ops.vcattn.attention.default
    out, seen = [], set()
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op != "call_function" or n.target is not target:
                continue
            if n.kwargs.get("key_mask") is not None:  # the keys it runs on are known at run time only
                continue
            a = _call_args(n)
            req = {"config": a.get("config"), "site": a.get("site"), "scale": a.get("scale"),
                   "rope": a.get("rope") or ""}
            ok = isinstance(req["config"], str) and isinstance(req["site"], int) \
                and (req["scale"] is None or isinstance(req["scale"], (int, float)))
            for name in _TENSORS:
                x = a.get(name)
                if x is None:
                    req[name] = None
                    continue
                t = val(x) if isinstance(x, fx.Node) else None
                spec = TensorSpec.of(t) if isinstance(t, torch.Tensor) else None
                if spec is None:
                    ok = False
                    break
                req[name] = dataclasses.asdict(spec)
            if not ok:
                continue
            key = _key(req)
            if key not in seen:
                seen.add(key)
                out.append(req)
    return out


def _steps(cfg) -> int:
    return max(1, int(cfg.num_steps))


def _schedule(req: dict) -> list:
    """The phase of every step of ``req``'s schedule (its config's ``num_steps``), or [] for a method that runs no
    kernel of ours."""
    from ..config import VCConfig
    from ..methods import get
    from ..methods.phase import Phase

    cfg = VCConfig.from_json(req["config"])
    M = get(cfg.resolved_method)
    if not M.USES_KERNELS:
        return []
    n = _steps(cfg)
    out, has_meta = [], False
    for i in range(n):
        p = M.phase_for(cfg, i, n, has_meta)
        has_meta = has_meta or p in (Phase.GROUP, Phase.ANCHOR, Phase.REUSE)
        out.append(p)
    return out


def plan_chains(req: dict) -> List[List[int]]:
    """The steps of ``req``'s schedule a helper runs, as chains that build in parallel: the first two steps of
    every run of one phase, once per (phase, phase before it) (a periodic schedule, e.g. V-Smooth's grouping
    every 25th step, repeats the same two runs), the warm-up phase's in a chain of its own (the rest starts
    from no metadata, as a method's first step after its warm-up may). Stock-SDPA steps are left out (no kernel
    of ours)."""
    from ..methods.phase import Phase

    warm, rest = [], []
    prev, before, run, seen, take = None, None, 0, set(), False
    for i, p in enumerate(_schedule(req)):
        if p != prev:
            before, run = prev, 0
            take = (p, before) not in seen
            seen.add((p, before))
        run += 1
        prev = p
        if p == Phase.DENSE or run > 2 or not take:
            continue
        (warm if p == Phase.WARMUP else rest).append(i)
    return [c for c in (warm, rest) if c]


class Prebuilds:
    """The helper processes of this process (``runtime.Runtime.prebuilds``). ``pending`` is the op's one check
    per call (a plain attribute: False once nothing is in flight)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending = False
        self._procs: List[dict] = []
        self._started: set = set()  # request keys already handed to a helper (a recompile of one shape: no second)
        self.done: List[dict] = []  # finished helpers: chain, seconds, ok, what it said or why it failed
        self.waited_s = 0.0  # what the op's first calls waited for them, in all
        self.cached = 0  # chains not started: a helper built them into this Triton cache before (its marker)
        self._idle: list = []  # helpers started ahead (``warm``), imports done, waiting for a job
        atexit.register(self.kill)

    def warm(self, n: int = 2) -> int:
        """Start helpers ahead of the rewrite (``vc_compile.enable``): their interpreter and imports (~2 s idle,
        7-10 s measured when started during Inductor's compile) run while Dynamo traces; ``start`` hands them
        jobs and ends those it has none for. Returns how many were started."""
        if os.environ.get(ENV_CHILD) == "1":
            return 0
        with self.lock:
            self._idle = [p for p in self._idle if p.poll() is None]
            need = max(0, n - len(self._idle))
        new = [p for p in (_launch() for _ in range(need)) if p is not None]
        with self.lock:
            self._idle.extend(new)
        return len(new)

    def forget(self) -> None:
        """What ``vc_compile.reset(report=True)`` forgets: the finished helpers' records and which layouts were
        handed out (a compile after it may start helpers again; their markers still spare finished builds)."""
        with self.lock:
            self.done.clear()
            self._started.clear()
            self.cached, self.waited_s = 0, 0.0

    def _drop_idle(self) -> None:
        with self.lock:
            idle, self._idle = self._idle, []
        for p in idle:
            _discard(p)

    def kill(self) -> None:
        """Stop the helpers still running (the process is exiting, or nobody will wait for them)."""
        with self.lock:
            procs, self._procs = self._procs, []
            idle, self._idle = self._idle, []
            self.pending = False
        for p in [rec["proc"] for rec in procs] + idle:
            if p.poll() is None:
                p.kill()

    def start(self, requests: List[dict]) -> int:
        """Start one helper per (request, chain) not started before and not built before into this Triton cache
        (a marker the helper leaves there on success); returns how many were started."""
        if os.environ.get(ENV_CHILD) == "1":
            return 0
        jobs = []
        with self.lock:
            for req in requests:
                key = _key(req)
                if key in self._started:
                    continue
                self._started.add(key)
                sched = _schedule(req)
                for chain in plan_chains(req):
                    job = dict(req, steps=chain, phases=sorted({sched[i].value for i in chain}))
                    job["marker"] = _marker_path(job)
                    if job["marker"] and os.path.exists(job["marker"]):
                        self.cached += 1  # built into this cache before: nothing to wait for
                        continue
                    jobs.append(job)
        started = 0
        for job in jobs:
            with self.lock:
                idle, self._idle = self._idle, []
            p = _spawn(job, idle)
            with self.lock:
                self._idle = idle + self._idle
            if p is None:
                continue
            with self.lock:
                self._procs.append({"proc": p, "job": job, "t0": time.perf_counter()})
                self.pending = True
            started += 1
        self._drop_idle()  # helpers started ahead that got no job: a later compile starts its own
        return started

    def wait(self, phase: Optional[str] = None, timeout: float = WAIT_S) -> None:
        """Wait for the helpers in flight that build ``phase`` (a ``Phase`` value; None: every helper), killed past
        ``timeout``: the op's first call of each phase after a start. Helpers that already ended are reaped too;
        the others go on (MC-Sparse's anchor and reuse kernels build during its warm-up steps)."""
        t0 = time.perf_counter()
        with self.lock:
            procs = [r for r in self._procs if phase is None or phase in r["job"].get("phases", ())
                     or r["proc"].poll() is not None]
            self._procs = [r for r in self._procs if r not in procs]
            self.pending = bool(self._procs)
        for rec in procs:
            p = rec["proc"]
            left = max(0.0, timeout - (time.perf_counter() - t0))
            try:
                p.wait(timeout=left)
                out, err = _read(p.vc_out), _read(p.vc_err)
                ok = p.returncode == 0
                what = _last_json(out) if ok else _tail(err, p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                _read(p.vc_out), _read(p.vc_err)
                ok, what = False, f"killed after waiting {timeout:.0f} s"
            self.done.append({"steps": rec["job"]["steps"], "phases": rec["job"].get("phases", []),
                              "shape": rec["job"]["q"]["shape"],
                              "s": time.perf_counter() - rec["t0"], "ok": ok, "said": what})
        if not self.pending:
            self._drop_idle()  # every job handed out and done: helpers started ahead and still idle end here
        waited = time.perf_counter() - t0
        self.waited_s += waited
        if procs:
            from ..log import get_logger

            bad = [d for d in self.done[-len(procs):] if not d["ok"]]
            log = get_logger(__name__)
            log.info("vcattn: %d kernel-build helper(s) finished; the call waited %.2f s", len(procs), waited)
            for d in bad:
                log.warning("vcattn: a kernel-build helper failed (the kernels are built at their first launch "
                            "instead): %s", d["said"])

    def summary(self) -> Optional[str]:
        """One line for ``report()``, or None when no helper ran."""
        if not self.done and not self._procs:
            return (f"kernels of {self.cached} call chain(s) found built by an earlier process's helpers"
                    if self.cached else None)
        bad = [d for d in self.done if not d["ok"]]
        longest = max(self.done, key=lambda d: d["s"], default=None)
        detail = ""
        if longest is not None and longest["ok"] and isinstance(longest["said"], dict):
            said = longest["said"]
            detail = (f": started {said.get('started_s', 0):.1f} s, ready {said.get('ready_s', 0):.1f} s, "
                      + (f"{said['built']} of {said['found']} kernels built in parallel in {said['build_s']:.1f} s, "
                         if "found" in said else "")
                      + "steps " + "+".join(f"{x:.1f}" for x in said.get("step_s", [])) + " s")
        line = (f"kernels built ahead by {len(self.done)} helper process(es) "
                f"(longest {longest['s'] if longest else 0.0:.1f} s{detail}); the first call waited "
                f"{self.waited_s:.2f} s")
        if self._procs:
            line += f"; {len(self._procs)} still running"
        if bad:
            line += f"; {len(bad)} failed (built at first launch instead): {bad[0]['said']}"
        return line


provide("prebuilds", lambda rt: Prebuilds())


def _prebuild_line() -> Optional[str]:
    """What the kernel-build helpers did (report()'s line)."""
    prebuilds = current().part("prebuilds")
    return prebuilds.summary() if prebuilds is not None else None


_report.line_source("prebuild", _prebuild_line)


def _tail(err: str, rc) -> str:
    lines = [x for x in (err or "").strip().splitlines() if x.strip()]
    return f"exit {rc}: {lines[-1][:300] if lines else 'no output'}"


def _last_json(out: str):
    for line in reversed((out or "").strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


_DIGEST: List[str] = []


def _source_digest() -> str:
    """Hash of the package's Python sources (kernels, dispatch, methods): a marker of an older tree never
    vouches for this one's kernels."""
    if not _DIGEST:
        h = hashlib.sha256()
        root = _PACKAGE_ROOT
        for d, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    h.update(f.encode())
                    with open(os.path.join(d, f), "rb") as fh:
                        h.update(fh.read())
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


def _marker_path(job: dict) -> Optional[str]:
    """Where a helper that built ``job`` successfully leaves its marker: in the Triton cache it filled (wiping
    the cache wipes the markers), keyed by the job, the package sources, torch, triton and the device."""
    cache = _triton_cache_dir()
    if not cache:
        return None
    import torch

    dev = job["q"]["device"]
    name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") and torch.cuda.is_available() \
        else dev
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    h = hashlib.sha256("|".join([_marker_key(job), _source_digest(), torch.__version__, tv, name]).encode())
    return os.path.join(cache, "vcattn_prebuild", h.hexdigest()[:32] + ".json")


# options that change which steps run a phase or what a call does around its kernels, never which kernels (and
# specialisations) a phase launches: left out of a marker's key, so that ``python -m vc_compile warmup``'s
# markers vouch for a pipeline's calls of the same layout and kernel options
_SCHEDULE_ONLY = ("num_steps", "warmup_steps", "anchor_steps", "anchor_interval", "group_interval",
                  "group_fraction", "profile", "warn_fallbacks", "prebuild", "speed_gate", "min_seq_len", "head_dims",
                  "mode", "residual_budget_gb", "max_logit_std", "rope_fusion")


def _marker_key(job: dict) -> str:
    """What a marker vouches for: the layouts of the tensors a phase's kernels read (not the block identity, a
    weight the op only compares, nor the scale, a float argument Triton never specialises on), the RoPE form,
    the options that choose kernels, and the phases built (not the step indices)."""
    cfg = json.loads(job["config"]) if isinstance(job["config"], str) else dict(job["config"])
    for name in _SCHEDULE_ONLY:
        cfg.pop(name, None)
    key = {name: job.get(name) for name in ("q", "k", "v", "cos", "sin", "rope")}
    key.update(config=cfg, phases=job.get("phases") or sorted({p.value for p in _schedule(job)}))
    return json.dumps(key, sort_keys=True)


def write_marker(marker: str, said: dict) -> None:
    """Leave the marker of a built job (atomically: a reader never sees half of it)."""
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(said, f)
    os.replace(tmp, marker)


def _launch():
    """A helper process that imports what a job needs and then waits for its job on stdin (one JSON line; end
    of input: it exits), or None if it cannot start."""
    env = dict(os.environ)
    env[ENV_CHILD] = "1"
    root = os.path.dirname(_PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    cache = _triton_cache_dir()
    if cache:
        env["TRITON_CACHE_DIR"] = cache  # the parent's, also where it was set in code
    # NOTE the helper's output goes to files, not pipes: nobody reads a pipe before the first call, and a helper
    # that fills one (warnings, a compiler's messages) would stall there, its builds with it
    try:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        p = subprocess.Popen([sys.executable, "-m", "vc_compile.prebuild.helpers"], stdin=subprocess.PIPE,
                             stdout=out, stderr=err, env=env, text=True)
        p.vc_out, p.vc_err, p.vc_t0 = out, err, time.time()
    except OSError:
        return None
    return p


def _hand(p, job: dict) -> bool:
    """Give ``job`` to the waiting helper ``p``; False if it is gone."""
    try:
        p.stdin.write(json.dumps(dict(job, t_spawn=p.vc_t0, t_job=time.time())) + "\n")
        p.stdin.close()
        return True
    except (OSError, ValueError):
        return False


def _spawn(job: dict, idle: Optional[list] = None):
    """A helper process running ``job`` (the request with its steps): one of ``idle`` (started earlier, its
    imports done) if any is still alive, else a new one; None if none can start."""
    while idle:
        p = idle.pop(0)
        if p.poll() is None and _hand(p, job):
            return p
        _discard(p)
    p = _launch()
    if p is not None and not _hand(p, job):
        _discard(p)
        return None
    return p


def _discard(p) -> None:
    """Let a helper go: a waiting one exits at the end of its input (closed here; nothing waits for it), and its
    output files are dropped."""
    try:
        if p.stdin and not p.stdin.closed:
            p.stdin.close()
    except OSError:
        pass
    for f in (p.vc_out, p.vc_err):
        if not f.closed:
            f.close()


def _read(f) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _triton_cache_dir() -> Optional[str]:
    """The parent's Triton cache directory where it was set in code (a helper inherits the environment's)."""
    try:
        import triton

        return getattr(getattr(getattr(triton, "knobs", None), "cache", None), "dir", None)
    except Exception:  # noqa: BLE001 - no triton: nothing to share
        return None


def _steps_of(job: dict, t: dict, cfg) -> List[float]:
    """The job's calls, each at its step of a sampling loop of the config's length; seconds per step."""
    import torch

    from ..runtime.steps import sampling

    step_s = []
    with torch.no_grad(), sampling(num_steps=_steps(cfg)) as loop:
        for i in job["steps"]:
            ts = time.perf_counter()
            loop.step(i)
            torch.ops.vcattn.attention(t["q"], t["k"], t["v"], t["ident"], job["site"], job["config"], job["scale"],
                                       t["cos"], t["sin"], job["rope"])
            if t["q"].is_cuda:
                torch.cuda.synchronize(t["q"].device)
            step_s.append(round(time.perf_counter() - ts, 2))
    return step_s


def discover(job: dict, t: dict, cfg) -> Tuple[list, Optional[str]]:
    """The job's steps run once with every Triton launch turned away before its build (Triton's
    ``jit_cache_hook`` answering True: neither built nor launched), recording each kernel's specialisation: the
    builds the real run will need, known before any of them starts. Outputs of that run are garbage and its
    state is dropped (``reset``); host code that trips over the garbage ends the run early (the reason is
    returned: what was found until then is still built ahead, the rest at its launch)."""
    import torch

    from ..tune import lookup

    was = current().tuning.as_dict()["directory"]
    err = None
    # a launch configuration tuned here would be timed on launches that never ran: tuned into a scratch cache
    # that is dropped (the real run tunes for real where no shipped or cached answer exists)
    with tempfile.TemporaryDirectory() as scratch, launches_turned_away() as found:
        lookup.configure(cache_dir=scratch)
        try:
            _steps_of(job, t, cfg)
        except Exception as e:  # noqa: BLE001 - garbage inputs downstream of a skipped kernel: stop discovering
            err = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            lookup.configure(cache_dir=was or "")
            if t["q"].is_cuda:
                torch.cuda.synchronize(t["q"].device)
            current().reset(report=True)
    return found, err


@contextlib.contextmanager
def launches_turned_away():
    """Inside the block, a Triton launch whose kernel is not built yet is neither built nor launched (Triton's
    ``jit_cache_hook`` answers True); yields the list it fills with each such kernel's ``(jit function,
    specialisation data)``, once per kernel and specialisation, for ``build_parallel``."""
    from triton import knobs

    found: Dict[tuple, tuple] = {}
    out: list = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        k = (fn.module, fn.name, str(key))
        if k not in found:
            found[k] = (fn.jit_function, compile["specialization_data"])
            out.append(found[k])
        return True

    prev, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        yield out
    finally:
        knobs.runtime.jit_cache_hook = prev


def build_parallel(found: list, device=None, workers: Optional[int] = None) -> Tuple[int, List[str]]:
    """Build every ``(jit function, specialisation)`` of ``found`` at once in a thread pool (Triton's passes and
    ptxas release the GIL: 3 Gluon kernels built in 5.7 s on 2 threads against 8.9 s one after the other,
    offline sm_90), each with its launcher module (a C compile, cached on disk like the kernel); each lands in
    its function's in-memory cache and Triton's disk cache under the key its launch computes. Returns (built,
    errors)."""
    import concurrent.futures as cf

    import torch

    if not found:
        return 0, []
    dev = torch.cuda.current_device() if device is None else device
    for fn, _ in found:
        fn.device_caches[dev]  # the per-device cache, made here once rather than raced for by the threads

    def one(item):
        fn, data = item
        if torch.cuda.is_available():
            torch.cuda.set_device(dev)  # preload builds for the thread's current device
        k = fn.preload(data)
        build_launcher(k)
        return k

    n = max(1, min(len(found), workers or os.cpu_count() or 1))
    built, errors = 0, []
    with cf.ThreadPoolExecutor(max_workers=n) as ex:
        for f in cf.as_completed([ex.submit(one, it) for it in found]):
            try:
                f.result()
                built += 1
            except Exception as e:  # noqa: BLE001 - that kernel is built at its launch instead
                errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    return built, errors


def build_launcher(k) -> None:
    """Compile the launcher module of the built kernel ``k`` (a C compile, ~1 s, cached on disk by Triton) so that
    its first launch only loads it; where that fails (a driver without launchers) the launch builds it."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(k.src, k.metadata)
    except Exception:  # noqa: BLE001 - built at the launch instead
        pass


def inputs(req: dict, seed: int = 0) -> dict:
    """Random tensors in the layouts of a request (or job): q, k, v, ident, cos, sin (None where absent)."""
    import torch

    gen = torch.Generator(device=req["q"]["device"]).manual_seed(seed)
    return {name: TensorSpec.from_json(req[name]).make(gen) if req.get(name) else None for name in _TENSORS}


def run_job(job: dict) -> dict:
    """In the helper: the job's calls on random inputs of its layouts, each at its step of a sampling loop of
    the config's length, after building every kernel they launch in parallel (``discover``, then
    ``build_parallel``). Returns what ran (phases and kernel paths, from this process's report) and the build's
    timings."""
    import torch

    from .. import ops  # noqa: F401  (registers torch.ops.vcattn.attention)
    from ..config import VCConfig

    # seconds from the helper's start to the job's start (interpreter, imports; a helper started ahead had them
    # done before its job came: then from the job's hand-over)
    started = time.time() - max(job.get("t_spawn", time.time()), job.get("t_job", 0.0))
    t_in = time.time()
    cfg = VCConfig.from_json(job["config"])
    t = inputs(job)
    if t["q"].is_cuda:
        torch.cuda.synchronize(t["q"].device)
    ready = started + (time.time() - t_in)  # + CUDA context and the inputs
    t0 = time.perf_counter()
    par = {}
    if t["q"].is_cuda:  # (the CPU reference path builds no kernel)
        found, why = discover(job, t, cfg)
        t1 = time.perf_counter()
        built, errors = build_parallel(found, t["q"].device.index)
        par = {"found": len(found), "built": built, "discover_s": round(t1 - t0, 2),
               "build_s": round(time.perf_counter() - t1, 2)}
        if why:
            par["discovery_stopped"] = why
        if errors:
            par["errors"] = errors[:3]
    step_s = _steps_of(job, t, cfg)
    rec = _report.site(job["site"])
    return {"steps": job["steps"], "s": round(time.perf_counter() - t0, 3), "started_s": round(started, 2),
            "ready_s": round(ready, 2), "step_s": step_s, "phases": dict(rec.phases),
            "kernels": dict(rec.kernel_path), "fallbacks": dict(rec.runtime_fallbacks), **par}


def main() -> int:
    # the imports a job needs, before its job arrives (a helper started ahead of the rewrite, ``Prebuilds.warm``)
    import torch  # noqa: F401

    from .. import ops  # noqa: F401
    from ..kernels import dispatch

    dispatch.triton_error()  # imports the kernel modules (triton, gluon)
    try:
        import select

        if not select.select([sys.stdin], [], [], IDLE_S)[0]:
            return 0  # no job came: the parent never compiled a graph with calls to build
    except (ImportError, OSError, ValueError):
        pass
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed after all
    job = json.loads(line)
    said = run_job(job)
    marker = job.get("marker")
    if marker:  # what ran here is what the parent will run (a fallback included): nothing left to build
        write_marker(marker, said)
    sys.stdout.write(json.dumps(said) + "\n")  # the parent reads the last JSON line (the protocol, not a message)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
