"""What the rewrite pass tells the user when it did less than they expect.

* :func:`warn_fallbacks`: one warning per compiled graph in which SDPA call sites were found but none,
  or only some, were rewritten, naming the most common reason and its fix (run under ``no_grad`` /
  ``inference_mode``, cast to bf16/fp16, the head dim, ...). The README one-liner on a model that runs
  with autograd on, or in fp32, rewrites nothing: before this, only ``report()`` said so. Short
  attention (the text cross-attention of every DiT, under ``min_seq_len``) stays quiet unless nothing
  in the graph was rewritten, and so do context-parallel DTensor calls (``cp_detect`` documents them).
  The text names the graph, so Python's default filter (one message text once per location) shows
  one warning per graph rather than swallowing the second model's. The pieces of one model (graph
  breaks) and its recompiles give one warning per reason, not one per piece. ``options=
  {"warn_fallbacks": False}`` silences it; ``counters["vcattn"]["fallback_warnings"]`` counts them.
* :func:`note_reference_path`: once per process and method, that a method runs the plain-PyTorch
  reference off CUDA (CPU: slow, for tests and the demo), unless ``kernels="reference"`` asked for it.
"""
from __future__ import annotations

import collections
import warnings
from typing import List, Optional, Set

from torch._dynamo.utils import counters

from .. import methods
from ..config import Kernels, VCConfig
from ..runtime.runtime import current
from .cp_detect import DTENSOR_REASON

HEAD_DIM_DYNAMIC = "head_dim marked dynamic"  # the rewrite's reason for a head dim Dynamo made symbolic
_SHORT = ("sequence too short", "cross-attention too short")


def _fix(reason: str, example, cfg: VCConfig) -> str:
    if reason == "requires grad":
        return ("q, k or v require grad (the model runs with autograd on; vcattn rewrites inference only): "
                "call the model under torch.no_grad() or torch.inference_mode() (diffusers pipelines do)")
    if reason == "dtype unsupported":
        return (f"q, k, v are {example.dtype} (the 8-bit kernels take bf16/fp16): cast the model, e.g. "
                "model.to(torch.bfloat16)")
    if reason == HEAD_DIM_DYNAMIC:
        return ("the head dim is marked dynamic (torch._dynamo.mark_dynamic): vcattn must specialise it (a "
                "DiT has one head dim); mark only the sequence dim dynamic, or use "
                "torch._dynamo.maybe_mark_dynamic")
    if reason == "head_dim unsupported":
        d = example.shape.split(" ")[0].split("x")[-1]
        d = f" ({d})" if d.isdigit() else ""
        return (f"the head dim{d} is not in head_dims={cfg.head_dims} (the kernels take 64 and 128): such "
                "attention stays stock SDPA")
    if reason in _SHORT:
        return (f"they have fewer than min_seq_len={cfg.min_seq_len} tokens (short attention is faster stock): "
                "lower options={'min_seq_len': ...} to rewrite them")
    if reason == "masked":
        return ("'masked': vcattn leaves attention with a mask to stock SDPA unless the mask is a boolean padding mask "
                "([B, 1, 1, Sk] or [B, 1, Sq, Sk], True for what is kept, as HunyuanVideo's)")
    return f"{reason!r}: vcattn leaves such attention (causal, dropout, GQA) to stock SDPA"


def warn_fallbacks(records: List, short: Set[int], cfg: VCConfig, graph_name: str,
                   root_id: Optional[int] = None) -> None:
    """Warn about the SDPA call sites of one compiled graph that stay stock (``records``: the graph's
    site records, rewritten or not; ``short``: the site ids whose query or key length is below
    ``min_seq_len``). Loud: a stock site of full length, whatever the reason; short sites only when
    nothing in the graph was rewritten and their length is the only reason (a small test model under
    ``min_seq_len``), never a short site stock for another reason too (Mochi's masked 1-query caption
    pooling). ``root_id`` (the compiled model, ``names.compiled_root_id``): the pieces of one model
    split by graph breaks, and its recompiles, say the same thing once per reason, not once per piece."""
    stock = [r for r in records if not r.rewritten]
    n_rw = len(records) - len(stock)
    loud = [r for r in stock if r.site not in short and r.reason != DTENSOR_REASON]
    if not loud and not n_rw:
        loud = [r for r in stock if r.reason in _SHORT]
    if not loud:
        return
    reason, count = collections.Counter(r.reason for r in loud).most_common(1)[0]
    if root_id is not None:
        if not current().once("fallback", (root_id, reason)):
            return
    example = next(r for r in loud if r.reason == reason)
    where = example.module or example.node
    sites = f"{count} site{'s' if count > 1 else ''}"
    counters["vcattn"]["fallback_warnings"] += 1
    warnings.warn(
        f"vcattn: in compiled graph {graph_name}, {n_rw} of {len(records)} scaled_dot_product_attention call "
        f"sites were rewritten and {len(stock)} stay stock SDPA, most often ({sites}, e.g. {where}) "
        f"because {_fix(reason, example, cfg)}. Each site and its reason: vc_compile.report(); silence "
        "this with options={'warn_fallbacks': False}.", UserWarning, stacklevel=3)


def note_reference_path(cfg: VCConfig, q) -> None:
    """Say once per process and method that a rewritten site will run the plain-PyTorch reference: q
    lives off CUDA and ``experimental["kernels"]`` is "auto" (a GPU without FP8 is noted by ``methods.resolve``)."""
    method = cfg.resolved_method
    dev = getattr(q, "device", None)
    if (cfg.experimental.kernels != Kernels.AUTO or not methods.get(method).USES_KERNELS or dev is None
            or dev.type in ("cuda", "meta")):
        return
    if not current().once("reference path", method.value):
        return
    warnings.warn(
        f"vcattn: {method.value} runs the plain-PyTorch reference on {dev.type} (slow: it is there for CPU "
        "tests and the demo; the Triton kernels run on CUDA GPUs). options={'experimental': {'kernels': "
        "'reference'}} asks for it explicitly and silences this note.", RuntimeWarning, stacklevel=3)
