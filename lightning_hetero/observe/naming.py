"""The running strategy's name, for messages from the modules both strategies share.

Example::
    >>> name_running_strategy(strategy)   # HeteroLifecycle.setup_environment, on every rank
    >>> rank_zero_warn(f"{running_strategy()}: `periodic_sync` needs two or more hosts ...")
"""

_running = ""


def name_running_strategy(strategy: object) -> None:
    """Remember ``strategy``'s class as the one this process runs (one strategy sets up per process)."""
    global _running
    _running = type(strategy).__name__


def running_strategy() -> str:
    """The class name of the strategy set up in this process (``"lightning_hetero"`` before any is)."""
    return _running or "lightning_hetero"
