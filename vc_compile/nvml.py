"""What NVML says about a CUDA device: the board, its clock and power limits, and its state right now.

Used by the tuning key (``tune/cache.py``: a power-capped or down-clocked GPU gets its own tuned
configurations) and by every benchmark row (``benchmarks/common.py``: the state explains noisy runs).
``pynvml`` comes from the ``nvidia-ml-py`` package; it is imported only here, only when asked, and any
failure (not installed, no driver, a CPU machine, an NVML call the driver lacks) gives None / fewer fields,
never an error.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional

# fields of ``limits()`` (fixed for a board and its settings) and of ``state()`` (now), in column order
LIMIT_FIELDS = ("gpu_uuid", "driver", "mem_gb", "power_limit_w", "sm_clock_max_mhz", "mem_clock_max_mhz")
STATE_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "temp_c", "power_w", "clock_events")


@functools.lru_cache(maxsize=1)
def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no package, no driver, no GPU
        return None


def _handle(nv, index: int):
    """NVML handle of CUDA device ``index`` (matched by UUID, so ``CUDA_VISIBLE_DEVICES`` is honoured)."""
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    except Exception:  # noqa: BLE001 - older torch / driver: the NVML index torch computes
        try:
            return nv.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(index))
        except Exception:  # noqa: BLE001
            return None


def _call(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a query this driver or board does not support
        return None


def _text(x) -> Optional[str]:
    return x.decode() if isinstance(x, bytes) else (str(x) if x is not None else None)


@functools.lru_cache(maxsize=None)
def limits(index: int = 0) -> Optional[Dict[str, Any]]:
    """The board's identity and limits: UUID, driver, memory (GB), enforced power limit (W), maximum SM
    and memory clocks (MHz). None without NVML."""
    nv = _nvml()
    h = _handle(nv, index) if nv is not None else None
    if h is None:
        return None
    mem = _call(nv.nvmlDeviceGetMemoryInfo, h)
    pl = _call(nv.nvmlDeviceGetEnforcedPowerLimit, h)
    out = {"gpu_uuid": _text(_call(nv.nvmlDeviceGetUUID, h)),
           "driver": _text(_call(nv.nvmlSystemGetDriverVersion)),
           "mem_gb": round(mem.total / 2**30) if mem is not None else None,
           "power_limit_w": round(pl / 1000) if pl is not None else None,
           "sm_clock_max_mhz": _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
           "mem_clock_max_mhz": _call(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM)}
    return {k: v for k, v in out.items() if v is not None}


def state(index: int = 0) -> Dict[str, Any]:
    """The device now: SM and memory clocks (MHz), temperature (C), power draw (W) and the active clock
    event (throttle) reasons as a hex mask (0x0 = none). {} without NVML."""
    nv = _nvml()
    h = _handle(nv, index) if nv is not None else None
    if h is None:
        return {}
    pw = _call(nv.nvmlDeviceGetPowerUsage, h)
    get_events = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    ev = _call(get_events, h) if get_events is not None else None
    out = {"sm_clock_mhz": _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
           "mem_clock_mhz": _call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
           "temp_c": _call(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
           "power_w": round(pw / 1000) if pw is not None else None,
           "clock_events": hex(ev) if ev is not None else None}
    return {k: v for k, v in out.items() if v is not None}


def tuning_suffix(index: int = 0) -> str:
    """The part of the tuning key NVML adds: ``"<mem>GB-<power limit>W-<max SM clock>MHz"`` ("" without
    NVML, which keeps the key a GPU had before)."""
    lim = limits(index)
    if not lim or not all(k in lim for k in ("mem_gb", "power_limit_w", "sm_clock_max_mhz")):
        return ""
    return f"{lim['mem_gb']}GB-{lim['power_limit_w']}W-{lim['sm_clock_max_mhz']}MHz"
