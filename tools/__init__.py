"""Tools people run from the repository root: ``python -m tools.render_results`` (the docs' tables),
``python -m tools.gen_gate_table`` / ``tools.gen_shipped_table`` (the package's generated JSON, ``--check``),
``python -m tools.triton_versions`` (the offline sm_90 build on several Triton releases), and the shell scripts
``bash tools/<name>.sh`` (demo, test, setup, test_triton, gpu_sweep)."""
