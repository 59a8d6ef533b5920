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


def save(fig: Any, path: str) -> str:
    """``fig`` laid out and written to ``path`` (a PNG at 120 dpi); the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
