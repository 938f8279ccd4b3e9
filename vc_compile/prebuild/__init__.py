"""Kernel builds ahead of the first call: helper processes that build the kernels a compiled graph will launch
(``helpers.py``) and the warm-up that fills the caches for a model ahead of time (``warmup.py``)."""
