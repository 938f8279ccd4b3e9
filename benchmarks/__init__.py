"""GPU benchmarks, one module per kernel plus end-to-end ones; run from the repository root as modules,
e.g. ``python -m benchmarks.bench_vsmooth_attn`` (``torchrun ... -m benchmarks.bench_context_parallel``).
Shared harness: ``benchmarks/common.py``; results: ``benchmarks/results/<bench>.csv``."""
