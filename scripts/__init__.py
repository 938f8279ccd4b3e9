"""Developer scripts (offline sm_90 codegen checks, A/B runs); the Python ones run from the repository root
as modules, e.g. ``python -m scripts.codegen_stats --json``. The shell scripts: ``bash scripts/<name>.sh``."""
