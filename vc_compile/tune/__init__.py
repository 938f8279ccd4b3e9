"""Per-architecture autotuning of the attention kernels' launch configurations: a service below
``kernels/dispatch.py`` that stores configurations as JSON dicts and imports no kernel.

``dispatch`` asks ``lookup.resolve`` once per launch of a tuned kernel (the Triton and Gluon V-Smooth kernels,
the sparse gather kernel); the answer, memoised per (kernel, dtype, head dim, sequence length, variant,
device) in the process, comes from, in this order:

``shipped``  ``shipped_<family>.json`` (sm90: the configurations measured on the H200, generated from
             ``kernels/configs.py`` by ``python3 -m tools.gen_shipped_table``): an H100/H200 tunes nothing;
``cache``    a JSON file per (GPU, compute capability, CUDA, Triton) and (kernel, source hash) under
             ``cache_dir()`` (``$VCATTN_CACHE_DIR``, else ``~/.cache/vc_compile/tune``), written by an
             earlier run on this machine;
``tuned``    benchmarked now with ``triton.testing.do_bench`` over the kernel's candidates (the
             variants that exist in its tables, the measured default first), each output validated
             against the default's, a tqdm progress bar, stored in the cache;
``default``  under ``TRITON_INTERPRET``, off CUDA, during CUDA graph capture or when every candidate
             failed: the first candidate, never tuned.

``configure(cache_dir=, shipped=, force=)`` changes the policy at run time; ``python -m vc_compile tune``
pre-tunes a shape (``vc_compile/tune_cli.py``); ``vc_compile.report()`` shows the source per call site (``config``).
Details: docs/autotune.md.
"""
from .cache import Arch, TuneKey, cache_dir, current_arch, get_config, make_key, seq_bucket
from .lookup import clear_memo, configure, recording, resolve

__all__ = ["Arch", "TuneKey", "cache_dir", "clear_memo", "configure", "current_arch", "get_config", "make_key",
           "recording", "resolve", "seq_bucket"]
