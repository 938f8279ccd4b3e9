"""Triton kernels ("templates"), one module per kernel, each mirroring ``vc_compile/reference/<name>.py``.

8-bit attention (issue 4): ``preprocess`` (Q/K smoothing, rotation, INT8/FP8 quantisation; V-Smooth
gather, block means, FP8 residual written K-major), ``vsmooth_attn`` (INT8 QK / FP8 PV attention with
mean compensation and optional ExpCast-FP8), ``kmeans`` (V grouping -> permutation).
MC-Sparse: ``pddp``, ``select``, ``sparse_attn``.

Nothing is imported here: importing a module compiles nothing and checks no GPU (CPU test collection
must work); kernels compile at their first launch.
"""
