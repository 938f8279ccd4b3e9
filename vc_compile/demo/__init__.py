"""The shipped demo: a small trained video DiT (diffusers' ``WanTransformer3DModel``) and its tools.

* ``python -m vc_compile.demo`` — generate one clip with dense bf16 attention and with every
  vcattn method, print time and fidelity (PSNR/SSIM vs dense), write a PNG grid and a GIF.
* ``python -m vc_compile.demo.train`` — how the shipped weights were trained (flow matching on
  synthetic moving-sprite clips).
* ``python -m vc_compile.demo.capture`` — save the model's real attention inputs (q, k, v).

Modules: ``model`` (config, text encoder, load/save), ``data`` (synthetic clips), ``sampler``
(flow-matching Euler), ``metrics`` (PSNR, SSIM), ``media`` (PNG grid, GIF), ``capture``, ``train``.
Importing this package imports neither diffusers nor the vcattn backend; the modules do, lazily.
"""
