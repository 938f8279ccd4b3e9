"""Per-architecture autotuning cache (see ``cache.py``)."""
from .cache import Arch, TuneKey, cache_dir, current_arch, get_config, make_key, seq_bucket

__all__ = ["Arch", "TuneKey", "cache_dir", "current_arch", "get_config", "make_key", "seq_bucket"]
