"""Run-time side of the backend: which step of how many a call is in (``steps``), per-site metadata
(``state``), the report (``report``). What a step does (its phase) is each method's schedule
(``vc_compile/methods``)."""
