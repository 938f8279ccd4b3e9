"""Context parallelism with ``backend="vcattn"``: Ulysses works, ring-style is detected and left stock.

Ulysses (DeepSpeed-Ulysses) context parallelism: every rank holds S/N tokens of every head; an
all-to-all turns that into all S tokens of H/N heads, each rank runs ordinary full-sequence attention on
its heads, and a second all-to-all turns the output back. The local attention is one plain
``scaled_dot_product_attention`` call, so the vcattn rewrite treats it like any other call site:

* metadata (V-Smooth permutations/centroids, MC-Sparse groups/selections/residuals) lives in the
  rank's own process, keyed by (site, block, branch, shape, device) as always; the shape carries the
  local head count H/N, and every head's metadata is computed from that head's full sequence, exactly as
  in a single-process run. Ranks never share or mix state because they never share a process (one
  process per rank is what diffusers and torchrun give you; see docs/context_parallel.md for the one
  unsupported layout, several ranks as threads of one process).
* step/phase detection is per process too, and agrees across ranks because every rank runs the same
  denoising loop (diffusers frame, ``vc_compile.sampling``/``step`` or call counting all see the same
  sequence of calls).

This module has two helpers:

``ulysses_attention(q, k, v, group)``
    The Ulysses pattern for models of your own (q, k, v in the diffusers layout [B, S_local, H, D]):
    all-to-all (functional collectives, traceable by Dynamo) -> ``F.scaled_dot_product_attention`` ->
    all-to-all back. Under ``torch.compile(..., backend="vcattn")`` its SDPA becomes ``vcattn::attention``.

``enable_diffusers_ulysses(model, ulysses_degree)``
    ``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=n))`` for diffusers models,
    also on CPU-only torch builds (gloo), where diffusers 0.42.1's own call fails: its
    ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, which
    is ``rank % 0`` -> ZeroDivisionError when there is no accelerator. Everything else in diffusers'
    Ulysses path (the split/gather hooks, ``TemplatedUlyssesAttention``, functional all-to-all) runs on
    gloo. With an accelerator present it simply calls diffusers' ``enable_parallelism``.

Ring attention (KV chunks merged by their log-sum-exp) is not supported: ``vcattn::attention``
returns no LSE, and a correct one would need the K-smoothing correction
``lse_true = lse_smoothed + q . kbar * sm`` for V-Smooth and has no meaning at MC-Sparse reuse steps
(sparse output + cached residual). Ring paths never reach SDPA in diffusers (its ``native`` backend
refuses ``return_lse``; ``_native_cudnn``/``_native_flash`` call the private aten kernels directly), so
vcattn already leaves them alone; ``vc_compile.passes.cp_detect`` says so in ``vc_compile.report()``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ulysses_attention", "enable_diffusers_ulysses", "prime_cp_hooks", "ULYSSES_BACKENDS",
           "attention_backend_of"]

# diffusers attention backends whose Ulysses path calls F.scaled_dot_product_attention (rewritable).
# _native_cudnn / _native_flash call aten's private kernels under context parallelism and flash / sage
# call third-party kernels: vcattn sees no SDPA there.
ULYSSES_BACKENDS = ("native",)


def _group(group):
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        return group.get_group()
    return group


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    shape = x.shape
    out = funcol.all_to_all_single(x.contiguous().flatten(), None, None, group)
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out = out.wait()
    return out.reshape(shape)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Ulysses context-parallel self-attention.

    q, k, v: this rank's [B, S_local, H, D] slices (the same S_local on every rank, H divisible by the
    group size). Returns this rank's [B, S_local, H, Dv] slice of the full-sequence attention output.
    The local attention is a plain SDPA call on [B, H/N, S, D], so ``backend="vcattn"`` rewrites it.
    """
    pg = _group(group)
    n = dist.get_world_size(pg)
    if n == 1:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return o.transpose(1, 2)
    B, S_loc, H, D = q.shape
    if H % n:
        raise ValueError(f"ulysses_attention: {H} heads are not divisible by the group size {n}")
    Hl = H // n

    def scatter_heads(x):  # [B, S_loc, H, D] -> [B, Hl, n * S_loc, D]
        d = x.shape[-1]
        x = x.reshape(B, S_loc, n, Hl, d).permute(2, 1, 0, 3, 4)  # [n, S_loc, B, Hl, d]
        x = _all_to_all(x, pg)  # block j now holds rank j's tokens of our heads
        return x.flatten(0, 1).permute(1, 2, 0, 3)  # [B, Hl, S, d]

    qh, kh, vh = scatter_heads(q), scatter_heads(k), scatter_heads(v)
    o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)  # [B, Hl, S, Dv]
    Dv = o.shape[-1]
    o = o.reshape(B, Hl, n, S_loc, Dv).permute(2, 3, 0, 1, 4)  # [n, S_loc, B, Hl, Dv]
    o = _all_to_all(o, pg)  # block j now holds our tokens of rank j's heads
    return o.permute(2, 1, 0, 3, 4).reshape(B, S_loc, H, Dv)


def attention_backend_of(model: torch.nn.Module) -> Optional[str]:
    """The diffusers attention backend name of the model's first attention processor (None: default)."""
    for m in model.modules():
        p = getattr(m, "processor", None)
        if p is not None and hasattr(p, "_attention_backend"):
            b = p._attention_backend
            return None if b is None else str(getattr(b, "value", b))
    return None


def enable_diffusers_ulysses(model: torch.nn.Module, ulysses_degree: Optional[int] = None, *, mesh=None):
    """Ulysses context parallelism on a diffusers model, also where diffusers' ``enable_parallelism``
    cannot resolve a device (CPU-only torch: ``rank % torch.accelerator.device_count()`` is ``rank % 0``).

    ``torch.distributed`` must be initialised (gloo on CPU, NCCL on GPUs). ``ulysses_degree`` defaults to
    the world size. Returns the ``ParallelConfig`` set on the model. Call it **before**
    ``torch.compile(model, backend="vcattn")``.

    On CPU it repeats what ``ModelMixin.enable_parallelism`` does (diffusers 0.42.1): build the
    ("ring", "ulysses") device mesh on the model's device type, ``ParallelConfig.setup``, point every
    attention processor at the config and install the model's ``_cp_plan`` hooks. That uses diffusers
    internals (``_parallel_config``, ``hooks.context_parallel.apply_context_parallel``); with an
    accelerator it calls the public ``enable_parallelism`` instead.
    """
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("enable_diffusers_ulysses: initialise torch.distributed first "
                           "(e.g. dist.init_process_group('gloo') on CPU, 'nccl' on GPUs)")
    world = dist.get_world_size()
    n = ulysses_degree or world
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None and heads % n:
        raise ValueError(f"enable_diffusers_ulysses: {heads} attention heads are not divisible by "
                         f"ulysses_degree={n} (diffusers' ulysses_anything mode lifts this; vcattn is "
                         f"untested with it)")
    backend = attention_backend_of(model)
    if backend not in (None, *ULYSSES_BACKENDS):
        import warnings

        warnings.warn(f"vcattn: attention backend {backend!r} runs its context-parallel attention without "
                      f"F.scaled_dot_product_attention, so vcattn cannot rewrite it; use "
                      f"model.set_attention_backend('native') for vcattn under Ulysses.", UserWarning,
                      stacklevel=2)
    cp = ContextParallelConfig(ulysses_degree=n, mesh=mesh)
    accel = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 0
    if accel > 0:
        model.enable_parallelism(config=cp)
        prime_cp_hooks(model)
        return model._parallel_config

    # CPU-only torch: what ModelMixin.enable_parallelism does, with the device taken from the model.
    from diffusers.hooks.context_parallel import apply_context_parallel
    from torch.distributed.device_mesh import init_device_mesh

    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError(f"Parallelism is already applied to this {type(model).__name__}.")
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no _cp_plan: diffusers cannot split its inputs")
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    cfg = ParallelConfig(context_parallel_config=cp)
    if mesh is None:
        mesh = init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    cfg.setup(dist.get_rank(), world, device, mesh=mesh)
    model._parallel_config = cfg
    for m in model.modules():
        p = getattr(m, "processor", None)
        if p is not None and hasattr(p, "_parallel_config"):
            p._parallel_config = cfg
    apply_context_parallel(model, cp, plan)
    prime_cp_hooks(model)
    return cfg


def prime_cp_hooks(model: torch.nn.Module) -> int:
    """Fill the forward-signature cache of diffusers' context-parallel split hooks ahead of time.

    ``ContextParallelSplitHook`` looks its module's ``forward`` signature up with ``inspect.signature``
    on its first call. Traced by Dynamo (the first call of a compiled model), that is a graph break: the
    model compiles into ~7 fragments with recompiles (automatic dynamic shapes then make the text length
    of cross-attention symbolic). Priming the cache (what the first eager call would do) keeps the
    compiled model one graph. Returns the number of hooks primed. Safe to call more than once.
    """
    import inspect

    try:
        from diffusers.hooks.context_parallel import ContextParallelSplitHook
    except Exception:
        return 0
    primed = 0
    for m in model.modules():
        registry = getattr(m, "_diffusers_hook", None)
        for hook in getattr(registry, "hooks", {}).values():
            meta = getattr(hook, "module_forward_metadata", None)
            if not isinstance(hook, ContextParallelSplitHook) or meta is None:
                continue
            if meta.cached_parameter_indices is None and meta._cls is not None:
                params = list(inspect.signature(meta._cls.forward).parameters.keys())[1:]  # skip self
                meta.cached_parameter_indices = {p: i for i, p in enumerate(params)}
                primed += 1
    return primed
