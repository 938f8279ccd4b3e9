"""The kernels ("kernels"), one module per kernel, each mirroring ``vc_compile/reference/<name>.py``, and the
two modules around them.

``dispatch``   the one place that chooses reference / Triton / Gluon per call and device, checks the kernels'
               limits and asks ``vc_compile/tune`` for a launch configuration; methods call it, never a kernel.
``configs``    the frozen launch-configuration dataclasses, the kernel modes (str Enums) and the measured
               default tables with their NOTEs.

Kernels, pure functions of (inputs, a launch configuration): 8-bit attention: ``preprocess`` (Q/K
smoothing, rotation, INT8/FP8 quantisation, the RoPE prologue of ``rope``; V-Smooth gather, block means, FP8
residual written K-major), ``vsmooth_attn`` (Triton: INT8/FP8 QK, FP8 PV, mean compensation, ExpCast),
``vsmooth_attn_sm90`` (the Gluon sm_90 kernel; ``_softmax``, ``_steps``), ``kmeans`` (V grouping). MC-Sparse:
``pddp``, ``select``, ``sparse_attn``. ``interpret`` and ``soft_round``: what the Triton interpreter (CPU tests)
needs.

Nothing is imported here: importing a module compiles nothing and checks no GPU (CPU test collection
must work); kernels compile at their first launch.
"""
