"""NVML readings of one GPU (utilisation, memory, power, temperature, SM clock, thermal throttling) for the monitor.

Optional: without ``nvidia-ml-py`` (extra ``monitor``) or a driver, every reading is NaN.

Example::
    >>> handle = nvml_handle(torch.device("cuda", 0))
    >>> dict(zip(NVML_FIELDS, nvml_readings(handle)))
"""

import math
from typing import Any

import torch

# Per-rank device readings (NaN when NVML is absent).
NVML_FIELDS = ("gpu_util", "mem_gib", "power_w", "temp_c", "sm_clock_mhz", "thermal_throttle")


def nvml_handle(device: torch.device) -> Any:
    """An NVML handle for ``device`` (matched by UUID), or ``None`` without ``nvidia-ml-py`` or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            found = pynvml.nvmlDeviceGetUUID(handle)
            found = found.decode() if isinstance(found, bytes) else found
            if found.replace("GPU-", "") == uuid.replace("GPU-", ""):
                return handle
        return None
    except Exception:
        return None


_THERMAL_BITS = ("nvmlClocksThrottleReasonSwThermalSlowdown", "nvmlClocksThrottleReasonHwThermalSlowdown",
                 "nvmlClocksThrottleReasonHwSlowdown", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown")


def nvml_readings(handle: Any) -> list[float]:
    """GPU utilisation %, memory used GiB, power W, temperature °C, SM clock MHz, thermal throttle (0/1); NaN where
    NVML is absent or a reading is not supported."""
    values = [math.nan] * len(NVML_FIELDS)
    if handle is None:
        return values
    import pynvml

    readers = [
        lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30,
        lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
        lambda: float(bool(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
                           & sum(getattr(pynvml, b, 0) for b in _THERMAL_BITS))),
    ]
    for i, read in enumerate(readers):
        try:
            values[i] = float(read())
        except Exception:
            pass
    return values
