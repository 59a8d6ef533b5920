"""matplotlib for the benchmarks' PNGs, when installed (extra ``plots``): headless, or ``None`` without it."""

from typing import Any, Optional


def pyplot() -> Optional[Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
