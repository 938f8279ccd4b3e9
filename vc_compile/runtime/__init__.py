"""Run-time side of the backend: which step and phase a call is in, per-site metadata, the report."""
