"""A finished job exits 0: the process groups this package created are shut down while the interpreter is whole.

Without it, the default process group (gloo: its worker threads, its rendezvous ``TCPStore``) lives until the
interpreter finalizes. A gloo worker or store thread that then touches Python (a tensor's last reference, the GIL) is
ended inside C++ code, and the process aborts with ``terminate called without an active exception`` (SIGABRT, exit
-6) after ``fit`` returned. Lightning's ``_init_dist_connection`` registers ``destroy_process_group`` at exit for NCCL
only; torch registers nothing (pytorch/pytorch#190489, #157193, #179291).

Example::
    >>> init_process_group(...)
    >>> destroy_process_groups_at_exit()   # once per process; a no-op at exit if the user destroyed them already
"""

import atexit
import signal

import torch.distributed as dist

_registered = False


def destroy_process_groups_at_exit() -> None:
    """Shut the default process group and every group made from it down at interpreter exit (registered once)."""
    global _registered
    if not _registered:
        atexit.register(destroy_process_groups)
        _registered = True


def destroy_process_groups() -> None:
    """``destroy_process_group()`` (every group, the default one's store with it) if one is still initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    # Ctrl+C at this point would leave the groups half shut down, the abort this avoids.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
