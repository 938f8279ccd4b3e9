"""The shipped demo: a small trained video DiT (diffusers' ``WanTransformer3DModel``) and its tools.

* ``python -m vc_compile.demo`` — generate one clip through a diffusers ``WanPipeline`` with dense bf16
  attention and with every vcattn method, print time and fidelity (PSNR/SSIM vs dense), write a
  labelled PNG grid, an MP4 and a GIF.
* ``python -m vc_compile.demo.train`` — how the shipped weights were trained (flow matching on
  synthetic moving-sprite clips).
* ``python -m vc_compile.demo.capture`` — save the model's real attention inputs (q, k, v).

Modules: ``model`` (config, text encoder, load/save), ``data`` (synthetic clips), ``sampler``
(flow-matching Euler: training samples, the benchmark), ``pipe`` (the model in diffusers'
``WanPipeline``), ``runner`` (one timed generation per method), ``metrics`` (PSNR, SSIM), ``media``
(labelled grid, GIF, MP4), ``capture``, ``train``. Requirements: the ``demo`` extra (diffusers,
safetensors, Pillow; imageio + imageio-ffmpeg for the MP4).
Importing this package imports neither diffusers nor the vcattn backend; the modules do, lazily.
"""
