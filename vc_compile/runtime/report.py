"""What happened at each attention call site, as data and as a table: ``vc_compile.report()``.

A *call site* is one ``scaled_dot_product_attention`` node of one compiled graph. The rewrite pass
registers every site it sees (rewritten or not, with the reason); the ``vcattn::attention`` op adds what
ran: calls per phase, the kernel path, where each kernel's launch configuration came from
(``config_sources``: shipped / cache / tuned / default, see ``vc_compile/tune``), run-time fallbacks,
time (with ``profile=True``) and the bytes of metadata the site holds.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from .runtime import current, provide

# Where report()'s summary lines come from: each is registered by the module that knows the answer (the
# kernel-build helpers, the kernel launcher, the kernel table), at its import; a module never imported
# leaves its line None (nothing of it ran).
LINE_SOURCES: Dict[str, Callable[[], Optional[str]]] = {}
LINES = ("prebuild", "launches", "builds")


def line_source(name: str, fn: Callable[[], Optional[str]]) -> None:
    """Register the function that writes report()'s ``name`` line (one of ``LINES``)."""
    if name not in LINES:
        raise ValueError(f"vc_compile report: {name!r} is not a report line ({LINES})")
    LINE_SOURCES[name] = fn


def _line(name: str) -> Optional[str]:
    fn = LINE_SOURCES.get(name)
    return fn() if fn is not None else None

# What the rewrite pass said about each site (module path, shape, ...), kept when ``clear()`` forgets the
# records: a compiled graph still calls its sites afterwards and their new records must name them.
_STATIC_FIELDS = ("graph", "node", "module", "shape", "dtype", "method", "rewritten", "reason", "has_identity",
                  "rope", "rope_fusion")


# report()'s line for sites whose MC-Sparse steps ran the gather kernel's opt-in 8-bit QK (sparse_qk='int8')
INT8_QK_LINE = ("sparse_qk='int8' at sites {sites}: the gather kernel's 8-bit QK, measured as a kernel only (1.09-1.13x "
                "the bf16 one at ~2x its error, plus 0.5-1.1 ms a call quantising K; "
                "docs/design/sparse-qk8-scale.md); MC-Sparse "
                "through it is not yet timed or checked end to end on a GPU")

# report()'s line for sites that ran on a GPU the speed gate has no measurements for
UNGATED_LINE = ("speed gate: no measurements for the {gpu} (sites {sites}): every call our kernels can run runs "
                "them, also at sizes where stock SDPA may be faster (on the H200: up to 12 heads x 8K tokens); "
                "measure this GPU (python -m benchmarks.bench_op_overhead, then python -m tools.gen_gate_table) "
                "or set speed_gate='off' to run ours everywhere knowingly")


@dataclass
class SiteRecord:
    site: int
    graph: str
    node: str
    module: str
    shape: str
    dtype: str
    method: str
    rewritten: bool
    reason: Optional[str] = None
    calls: int = 0
    phases: collections.Counter = field(default_factory=collections.Counter)
    kernel_path: collections.Counter = field(default_factory=collections.Counter)
    runtime_fallbacks: collections.Counter = field(default_factory=collections.Counter)
    # calls a method ran on another of its own kernel paths (not stock SDPA), by why: MC-Sparse's memory plan
    method_notes: collections.Counter = field(default_factory=collections.Counter)
    step_sources: collections.Counter = field(default_factory=collections.Counter)
    # "<kernel>:<source>" -> launches; source = where the launch config came from (vc_compile/tune):
    # shipped (measured table), cache (tuned earlier on this machine), tuned (now), default (no tuning)
    config_sources: collections.Counter = field(default_factory=collections.Counter)
    time_ms: float = 0.0
    bytes_held: int = 0
    # MC-Sparse quality guard (methods/mcsparse_guard.py): anchors it triggered, readings taken, and the
    # largest relative reuse error it read (NaN readings, from NaN/Inf inputs, are not counted)
    guard_anchors: int = 0
    guard_readings: int = 0
    guard_err_max: float = 0.0
    # the quantisation check's last reading here (reference/quant_check.Reading) and what it chose, None = none taken
    quant_reading: Optional[tuple] = None
    # calls whose output held NaN/Inf (counted on the CPU reference path only: elsewhere it would cost a sync;
    # the contract: ops.NONFINITE_CONTRACT)
    nonfinite_calls: int = 0
    has_identity: bool = True
    rope: Optional[str] = None  # RoPE producer form of q/k (passes/rope_detect.py), None = not analysed
    rope_fusion: Optional[str] = None  # "fused" / "unfused: <reason>" (passes/rope_fuse.py), None = no RoPE
    # why this site's reuse steps are not replayed as CUDA graphs although the option allows it (a failed
    # capture; kernels/graphs.py), None = no failure
    cuda_graph_failure: Optional[str] = None
    # why this site's reuse steps run the op's whole Python path instead of a recorded launch sequence
    # (kernels/programs.py: a recording refused), None = no refusal
    program_failure: Optional[str] = None
    # the GPU this site's calls ran our kernels on with the speed gate on but no measurements for that GPU in
    # its table (tune/gate.py: nothing is gated there), "" = none
    ungated_gpu: str = ""
    # a padding mask's kept keys at the last masked call ("L of Sk keys": the method ran on those; ops.key_prefix),
    # "" = no masked call
    key_padding: str = ""
    _pending: list = field(default_factory=list, repr=False)

    def note_guard(self, err: Optional[float], reanchor: bool) -> None:
        if err is not None and err == err:
            self.guard_readings += 1
            self.guard_err_max = max(self.guard_err_max, err)
        if reanchor:
            self.guard_anchors += 1
            from torch._dynamo.utils import counters

            counters["vcattn"]["guard_anchor"] += 1

    def resolve_timing(self) -> None:
        if self._pending:
            torch.cuda.synchronize()
            for a, b in self._pending:
                self.time_ms += a.elapsed_time(b)
            self._pending.clear()


class SiteRegistry:
    """Every call site seen in this process and what ran there (``runtime.Runtime.sites``; the module
    functions below act on the current runtime's)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sites: Dict[int, SiteRecord] = {}
        self.issued = 0  # the last site id given (ids only grow)
        self.empty_graphs: List[str] = []
        self.by_key: Dict[tuple, int] = {}  # call-site identity (rewrite pass) -> site id
        self.forgotten: Dict[int, dict] = {}  # site -> its _STATIC_FIELDS, kept by ``clear()``
        self.retired: Dict[str, list] = {}  # graph -> its stock-SDPA site records ``retire_from`` dropped

    def register_site(self, key: Optional[tuple] = None, **kw) -> SiteRecord:
        with self.lock:
            if key is not None:
                rec = self.sites.get(self.by_key.get(key, -1))
                if rec is not None:
                    return rec
            self.issued += 1
            rec = SiteRecord(site=self.issued, **kw)
            self.sites[rec.site] = rec
            if key is not None:
                self.by_key[key] = rec.site
            return rec

    def site(self, site_id: int) -> SiteRecord:
        rec = self.sites.get(site_id)
        if rec is None:
            with self.lock:
                known = self.forgotten.get(site_id) or dict(graph="?", node="?", module="?", shape="?",
                                                            dtype="?", method="?", rewritten=True)
                rec = self.sites.setdefault(site_id, SiteRecord(site=site_id, **known))
                for quiet in self.retired.pop(known["graph"], ()):  # a retired graph runs again: all its sites
                    self.sites.setdefault(quiet.site, quiet)
        return rec

    def get(self, site_id: int) -> Optional[SiteRecord]:
        """The record of ``site_id`` if one is held (never makes one)."""
        return self.sites.get(site_id)

    def find_site(self, graph: str, node: str) -> Optional[SiteRecord]:
        with self.lock:
            return next((r for r in self.sites.values() if r.graph == graph and r.node == node), None)

    def busy(self) -> bool:
        return self.lock.locked()

    def set_bytes_held(self, sites=None, value: int = 0) -> None:
        with self.lock:
            recs = list(self.sites.values()) if sites is None else [self.sites[s] for s in sites if s in self.sites]
        for rec in recs:
            rec.bytes_held = value

    def note_empty_graph(self, name: str) -> None:
        self.empty_graphs.append(name)

    def report(self) -> "Report":
        with self.lock:
            sites = sorted(self.sites.values(), key=lambda r: r.site)
        for s in sites:
            s.resolve_timing()
        return Report(sites=sites, graphs_without_sdpa=list(self.empty_graphs),
                      prebuild=_line("prebuild"), launches=_line("launches"), builds=_line("builds"))

    def watermark(self) -> int:
        """The id the next registered site gets (the counter's; a record made for an op called by hand with an id
        of its own does not move it)."""
        with self.lock:
            return self.issued + 1

    def retire_from(self, first: int) -> int:
        """Drop the records of the sites registered at or after id ``first`` (an undone compile's) from the report,
        as ``clear()`` drops all: a later call of such a site finds its record again. Returns how many."""
        with self.lock:
            gone = [s for s in self.sites if s >= first]
            for s in gone:
                rec = self.sites.pop(s)
                self._forget(rec)
                if not rec.rewritten:  # never called: listed again only when its graph runs again
                    self.retired.setdefault(rec.graph, []).append(rec)
            for key in [k for k, s in self.by_key.items() if s >= first]:
                del self.by_key[key]
            return len(gone)

    def _forget(self, rec: SiteRecord) -> None:
        """Keep what the rewrite pass said of ``rec`` (a later call of its site finds it); the lock is held."""
        self.forgotten[rec.site] = {f: getattr(rec, f) for f in _STATIC_FIELDS}

    def clear(self) -> None:
        with self.lock:
            for rec in self.sites.values():
                self._forget(rec)
            self.sites.clear()
            self.retired.clear()
            self.empty_graphs.clear()
            self.by_key.clear()

    def reset_counts(self) -> None:
        with self.lock:
            for s in self.sites.values():
                s.calls, s.time_ms = 0, 0.0
                s.guard_anchors, s.guard_readings, s.guard_err_max = 0, 0, 0.0
                s.nonfinite_calls = 0
                s._pending.clear()
                for c in (s.phases, s.kernel_path, s.runtime_fallbacks, s.method_notes, s.step_sources,
                          s.config_sources):
                    c.clear()


def register_site(key: Optional[tuple] = None, **kw) -> SiteRecord:
    """A new site record, or with ``key`` (the rewrite pass's call-site identity, the same in a
    recompiled graph: see ``passes/sdpa_rewrite._site_keys``) the record already registered under it,
    so a recompile for another grad mode finds the site id, and with it the metadata, it had."""
    return current().sites.register_site(key, **kw)


def op_calls() -> int:
    """Calls of the op so far, over every site (each call counts once, whatever path it took)."""
    sites = current().sites
    with sites.lock:
        return sum(s.calls for s in sites.sites.values())


def site(site_id: int) -> SiteRecord:
    """The record of ``site_id`` (one is made, naming what the rewrite pass said about it, when none is held:
    a site called again after reset(report=True), or an op called by hand)."""
    return current().sites.site(site_id)


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``65536`` -> ``"64.0 KiB"``): a
    small size never prints as ``0.00 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def find_site(graph: str, node: str) -> Optional[SiteRecord]:
    """The record of the call site at ``node`` of ``graph``, or None."""
    return current().sites.find_site(graph, node)


def busy() -> bool:
    """Whether some thread holds the records' lock now (a weakref finalizer that runs inside a garbage
    collection must not wait for it)."""
    return current().sites.busy()


def set_bytes_held(sites=None, value: int = 0) -> None:
    """Set the metadata bytes of ``sites`` (all sites when None) to ``value``."""
    current().sites.set_bytes_held(sites, value)


def note_empty_graph(name: str) -> None:
    current().sites.note_empty_graph(name)


provide("sites", lambda rt: SiteRegistry())


class Timer:
    """Times one op call into a site record: CUDA events (resolved lazily, no sync) or a wall clock."""

    def __init__(self, rec: SiteRecord, enabled: bool, cuda: bool):
        self.rec, self.enabled, self.cuda = rec, enabled, cuda

    def __enter__(self):
        if self.enabled:
            if self.cuda:
                self.a = torch.cuda.Event(enable_timing=True)
                self.b = torch.cuda.Event(enable_timing=True)
                self.a.record()
            else:
                self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.enabled and exc[0] is None:
            if self.cuda:
                self.b.record()
                self.rec._pending.append((self.a, self.b))
            else:
                self.rec.time_ms += (time.perf_counter() - self.t0) * 1e3


def _clip(text: str, width: int) -> str:
    """The end of a long module path (its most specific part), marked as clipped."""
    return text if len(text) <= width else "..." + text[-(width - 3):]


def config_column(sources: collections.Counter) -> str:
    """``{"vsmooth_attn:shipped": 3}`` -> ``"vsmooth_attn=shipped"`` (all sources of a kernel, by name)."""
    by_kernel: Dict[str, List[str]] = {}
    for name in sorted(sources):
        kernel, _, src = name.partition(":")
        by_kernel.setdefault(kernel, []).append(src)
    return " ".join(f"{k}={'/'.join(v)}" for k, v in by_kernel.items())


@dataclass
class Report:
    sites: List[SiteRecord]
    graphs_without_sdpa: List[str]
    prebuild: Optional[str] = None  # what the kernel-build helpers did (prebuild/helpers.py), None: none ran
    launches: Optional[str] = None  # how our kernels were launched (kernels/launch.py), None: none was
    builds: Optional[str] = None  # kernels that did not build on this toolchain and what ran instead, None: none

    @property
    def rewritten(self) -> List[SiteRecord]:
        return [s for s in self.sites if s.rewritten]

    @property
    def fallbacks(self) -> List[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    @property
    def total_time_ms(self) -> float:
        return sum(s.time_ms for s in self.sites)

    @property
    def bytes_held(self) -> int:
        return sum(s.bytes_held for s in self.sites)

    def phase_counts(self) -> collections.Counter:
        c = collections.Counter()
        for s in self.sites:
            c.update(s.phases)
        return c

    def to_dict(self) -> dict:
        out = []
        for s in self.sites:
            d = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if not f.name.startswith("_")}
            for key in ("phases", "kernel_path", "runtime_fallbacks", "method_notes", "step_sources", "config_sources"):
                d[key] = dict(d[key])
            out.append(d)
        return {"sites": out, "graphs_without_sdpa": list(self.graphs_without_sdpa), "prebuild": self.prebuild,
                "launches": self.launches, "builds": self.builds}

    def __str__(self) -> str:
        cols = ["site", "module", "shape", "method", "calls", "phases", "kernel", "config", "fallback", "ms",
                "MB held"]
        rows = []
        for s in self.sites:
            fb = s.reason or ", ".join(f"{k} x{v}" for k, v in s.runtime_fallbacks.items())
            phases = " ".join(f"{k}:{v}" for k, v in sorted(s.phases.items()))
            if s.guard_readings:
                phases += f" (guard {s.guard_anchors}, err<={s.guard_err_max:.3f})"
            # "-", not 0: a stock-SDPA site is not counted (the op is not in its path), and times are taken
            # only with profile=True
            rows.append([str(s.site), _clip(s.module or "-", 48), s.shape, s.method if s.rewritten else "sdpa",
                         str(s.calls) if s.rewritten or s.calls else "-", phases,
                         ",".join(sorted(s.kernel_path)), config_column(s.config_sources) or "-",
                         fb or "-", f"{s.time_ms:.2f}" if s.time_ms > 0 else "-",
                         f"{s.bytes_held / 2**20:.1f}"])
        if not rows:
            msg = "vc_compile report: no attention call sites compiled yet"
            if self.graphs_without_sdpa:
                msg += f"\ngraphs with no SDPA captured: {', '.join(self.graphs_without_sdpa)}"
            return msg
        from ..table import format_table

        lines = [format_table(rows, cols)]
        n_rw = len(self.rewritten)
        timed = (f"attention time {self.total_time_ms:.2f} ms" if self.total_time_ms > 0 else
                 "attention not timed (options={'profile': True} times every call)")
        lines.append(f"{n_rw} of {len(self.sites)} call sites rewritten; {timed}; metadata held "
                     f"{self.bytes_held / 2**20:.1f} MB")
        unfused = [f"{s.site} ({s.rope_fusion[len('unfused: '):]})" for s in self.sites
                   if s.rewritten and s.rope_fusion and s.rope_fusion.startswith("unfused")
                   and not s.rope_fusion.startswith(("unfused: method ", "unfused: disabled"))]
        if unfused:
            lines.append(f"RoPE not fused into the kernel at sites: {', '.join(unfused)}")
        notes = collections.Counter()
        for s in self.sites:
            notes.update({k: 1 for k in s.method_notes})
        for why, n in notes.items():
            lines.append(f"{why}: {n} site(s)")
        no_graph = [f"{s.site} ({s.cuda_graph_failure})" for s in self.sites if s.cuda_graph_failure]
        if no_graph:
            lines.append(f"CUDA graph capture failed (launched from Python instead) at sites: {', '.join(no_graph)}")
        no_program = [f"{s.site} ({s.program_failure})" for s in self.sites if s.program_failure]
        if no_program:
            lines.append(f"reuse steps not recorded as launch sequences (the op's whole Python path instead) at "
                         f"sites: {', '.join(no_program)}")
        if self.graphs_without_sdpa:
            lines.append(f"graphs with no SDPA captured: {', '.join(self.graphs_without_sdpa)}")
        int8_qk = [str(s.site) for s in self.sites if any(p.endswith("+int8_qk") for p in s.kernel_path)]
        if int8_qk:
            lines.append(INT8_QK_LINE.format(sites=", ".join(int8_qk)))
        ungated: Dict[str, List[str]] = {}
        for s in self.sites:
            if s.ungated_gpu:
                ungated.setdefault(s.ungated_gpu, []).append(str(s.site))
        for gpu, sites in ungated.items():
            lines.append(UNGATED_LINE.format(gpu=gpu, sites=", ".join(sites)))
        padded = [f"{s.site} ({s.key_padding})" for s in self.sites if s.key_padding]
        if padded:
            lines.append(f"padding masks: the method ran on the kept keys at sites {', '.join(padded)} (query "
                         "rows past them on stock SDPA)")
        if self.prebuild:
            lines.append(self.prebuild)
        if self.launches:
            lines.append(self.launches)
        if self.builds:
            lines.append(self.builds)
        return "\n".join(lines)

    __repr__ = __str__


def report() -> Report:
    """A snapshot of every call site seen in this process (resolves pending CUDA timings)."""
    return current().sites.report()


def clear() -> None:
    """Forget every site record and count (used by ``vc_compile.reset(report=True)``). A site called again
    afterwards gets a fresh record that still names its module, shape and method."""
    current().sites.clear()


def reset_counts() -> None:
    """Zero the run-time counts of every site but keep the sites (used between demo runs)."""
    current().sites.reset_counts()
