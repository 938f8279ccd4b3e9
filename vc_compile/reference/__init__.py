"""Plain-PyTorch reference implementations: the oracle for every kernel's tests and the CPU path.

One module per kernel, with the same name and signatures as ``vc_compile/kernels/<kernel>.py``.
"""
