"""``backend="vcattn"``: validate options, rewrite SDPA on the Dynamo graph, hand the graph to Inductor.

Registered only through the ``torch_dynamo_backends`` entry point (setup.py), so
``torch.compile(model, backend="vcattn")`` works in a fresh interpreter that never imported
``vc_compile``. This module must not call ``register_backend`` itself: torch would then raise
"duplicate name: vcattn" on the lazy entry-point path.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch

from .config import Compiler, VCConfig
from .passes.sdpa_rewrite import rewrite_sdpa

_GRAPH_IDS = itertools.count(1)
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def inductor_patches(cfg: VCConfig) -> dict:
    """Inductor settings for ``mode``, scoped to this compile through ``config_patches`` (never global)."""
    if not cfg.mode or cfg.mode == "default":
        return {}
    patches = dict(torch._inductor.list_mode_options(cfg.mode))
    if patches.get("triton.cudagraphs"):
        # vcattn::attention is tagged cudagraph_unsafe: the CUDA graph is partitioned around it so its
        # Python (step tracking, metadata) runs on every call instead of being frozen at record time.
        from torch._inductor import config as inductor_config

        if hasattr(inductor_config, "graph_partition"):
            patches["graph_partition"] = True
    return patches


def vcattn(gm: torch.fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options=None, **_):
    cfg = VCConfig.from_options(options, mode)
    name = f"vcattn_graph_{next(_GRAPH_IDS)}"
    rewrite_sdpa(gm, cfg, graph_name=name)
    if cfg.compiler == Compiler.EAGER:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_patches(cfg))
