"""``resilience.resume``: a re-run of the same command goes on from the checkpoint recording the most progress.

That checkpoint (global step, then epoch: :func:`~lightning_hetero.resilience.checkpoint.choose_checkpoint`) is
resolved in each process before ``Trainer.fit`` selects its checkpoint, and handed to Lightning through the public
``trainer.ckpt_path``; an explicit ``fit(ckpt_path=...)`` wins. The resolution runs in Lightning's own launchers
(subclassed here, so every launch path goes through it: the popen launcher also runs under torchrun and SLURM, where
it starts no processes).
"""

import inspect
from typing import Any, Callable, Optional

from lightning_hetero._compat import FIT_FUNCTION_NAME, SubprocessScriptLauncher
from lightning_hetero.resilience.checkpoint import find_resume_checkpoint
from lightning_hetero.resilience.launcher import ReportingLauncher
from lightning_hetero.resilience.preemption import forwarding_signals


def checkpoint_to_resume(resume: Optional[str], trainer: Any) -> Optional[str]:
    """The checkpoint recording the most progress where ``resume`` points (``"auto"``: the ``ModelCheckpoint``
    directories), or ``None``."""
    if resume is None:
        return None
    if resume == "auto":
        directories = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        if not directories:
            raise ValueError(
                "`resilience.resume`='auto' looks for checkpoints in the `dirpath` of the trainer's `ModelCheckpoint` "
                "callbacks, and none has one: pass `ModelCheckpoint(dirpath=...)` or `resume=<directory>`."
            )
    else:
        directories = [resume]
    return find_resume_checkpoint(resume, directories)  # a mistyped directory is an error


def resolve_resume(resume: Optional[str], function: Callable, args: tuple, kwargs: dict, trainer: Any) -> bool:
    """Before ``fit`` runs: point ``trainer.ckpt_path`` at the furthest checkpoint unless ``fit`` was given one.
    True when it did (the caller resets it after ``fit``, so a later ``test`` is not pointed at it)."""
    if resume is None or trainer is None or getattr(function, "__name__", "") != FIT_FUNCTION_NAME:
        return False
    try:
        given = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except TypeError:
        given = None
    if given is not None or trainer.ckpt_path is not None:
        return False  # the user's explicit choice
    found = checkpoint_to_resume(resume, trainer)  # says which one it chose, and why, in one line
    if found is None:
        return False
    trainer.ckpt_path = found
    return True


def launch_resolved(launch: Callable, resume: Optional[str], function: Callable, args: tuple, kwargs: dict,
                    trainer: Any) -> Any:
    resolved = resolve_resume(resume, function, args, kwargs, trainer)
    try:
        return launch(function, *args, trainer=trainer, **kwargs)
    finally:
        if resolved:
            trainer.ckpt_path = None


class ResumingSubprocessLauncher(SubprocessScriptLauncher):
    """Lightning's script launcher (popen; torchrun and SLURM, where it starts no processes) that resolves resume."""

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 resume: Optional[str] = None) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.resume = resume

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        return launch_resolved(super().launch, self.resume, function, args, kwargs, trainer)


class ResumingMultiProcessingLauncher(ReportingLauncher):
    """Lightning's spawn/fork launcher whose ranks report their own errors to the watchdog, resolving resume in the
    parent (the children get its trainer)."""

    def __init__(self, strategy: Any, start_method: str = "spawn", resume: Optional[str] = None) -> None:
        super().__init__(strategy, start_method=start_method)
        self.resume = resume

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        with forwarding_signals(self):  # SIGTERM to this parent reaches the ranks
            return launch_resolved(super().launch, self.resume, function, args, kwargs, trainer)


def resuming_launcher(strategy: Any, start_method: str, resume: Optional[str]) -> Any:
    """Lightning's launcher for ``start_method`` (``"popen"``: the script launcher) resolving ``resume`` to the
    trainer's ``ckpt_path`` before ``fit`` starts.

        >>> strategy._launcher = resuming_launcher(strategy, "spawn", resume="last")
    """
    if start_method == "popen":
        return ResumingSubprocessLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes,
                                          resume=resume)
    return ResumingMultiProcessingLauncher(strategy, start_method=start_method, resume=resume)
