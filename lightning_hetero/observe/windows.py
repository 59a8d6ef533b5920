"""Rank 0's record of the :class:`~lightning_hetero.observe.monitor.HeteroMonitor`'s logged windows: each window
analysed (:func:`~lightning_hetero.observe.analysis.analyse`), logged as metrics, appended to the
``hetero_monitor.jsonl`` sidecar, and summed after warm-up for the table and the advice printed at the end of ``fit``.

Example::

    record = WindowRecord(warmup_steps=1)
    record.open_sidecar(log_dir)
    record.add(trainer, steps, nvml, steps_done=8, pipelines=None)  # on each logging step, rank 0
    record.print_end(strategy, summary=True, warn=True, pipelines=None)  # at the end of fit
    record.close()
"""

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any, Optional

from lightning.pytorch import Trainer

from lightning_hetero.observe.analysis import accumulate, advice, analyse, print_summary, totals_window
from lightning_hetero.observe.nvml import NVML_FIELDS
from lightning_hetero.view import ObservedStrategy

SIDECAR = "hetero_monitor.jsonl"


class WindowRecord:
    """Every logged window of one fit (``windows``) and the sums per rank after ``warmup_steps`` (``totals``)."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.windows: list[dict[str, Any]] = []  # every logged window (what the sidecar holds)
        self.totals: Optional[dict[str, list[float]]] = None  # sums per rank after warm-up
        self.summary_steps: Optional[tuple[int, ...]] = None  # first and last step the totals cover
        self._nvml_util: Sequence[float] = ()  # the last window's GPU utilisation per rank
        self._sidecar: Optional[IO[str]] = None

    def open_sidecar(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._sidecar = open(os.path.join(log_dir, SIDECAR), "w")  # written and flushed once a window

    def close(self) -> None:
        if self._sidecar is not None:
            self._sidecar.close()
            self._sidecar = None

    def add(self, trainer: Trainer, steps: list[list[list[float]]], nvml: list[list[float]], steps_done: int,
            pipelines: Optional[list[list[int]]]) -> None:
        """One window: ``steps[rank][step]`` rows, ``nvml[rank]`` readings; ``steps_done`` this run's steps so far."""
        n = len(steps[0])
        window = analyse(steps, first_step=trainer.global_step - n, pipelines=pipelines)
        window.update(step=int(trainer.global_step),
                      nvml={name: [readings[i] for readings in nvml] for i, name in enumerate(NVML_FIELDS)})
        skip = max(0, self.warmup_steps - (steps_done - n))  # steps of this run, not global
        if skip < n:
            kept = analyse([rows[skip:] for rows in steps], first_step=window["first_step"] + skip,
                           pipelines=pipelines) if skip else window
            self.totals = accumulate(self.totals, kept)
            self.summary_steps = (self.summary_steps or (kept["first_step"] + 1,))[:1] + (int(trainer.global_step),)
        self.windows.append(window)
        if trainer.logger is not None:
            trainer.logger.log_metrics(window_metrics(window), step=trainer.global_step)
        if self._sidecar is not None:
            self._sidecar.write(json.dumps(_jsonable(window)) + "\n")
            self._sidecar.flush()  # a crash loses no logged window
        self._nvml_util = window["nvml"]["gpu_util"]

    def print_end(self, strategy: Optional[ObservedStrategy], summary: bool, warn: bool,
                  pipelines: Optional[list[list[int]]]) -> None:
        """The table over the steps after warm-up and, under it, what would pay off over them (printed once)."""
        if self.totals is None:
            return
        if summary:
            print_summary(self.totals, self.summary_steps, pipelines)
        if not warn:
            return
        found = advice(totals_window(self.totals, self.summary_steps), nvml_util=self._nvml_util,
                       capacity_source=strategy.capacity_source if strategy is not None else None,
                       rebalance=strategy.rebalancing if strategy is not None else None,
                       sharded=strategy is not None and strategy.sharded)
        if found:
            print("\n".join(["Advice (what would pay off in this run):"] + [f"- {m}" for _, m in found]), flush=True)


def window_metrics(window: Mapping[str, Any]) -> dict[str, float]:
    """A logged window as the logger's metrics (``monitor/...``); a pipeline's stage ranks' parts on those ranks."""
    metrics: dict[str, float] = {}
    for name in ("compute", "wait", "data", "comm"):
        for r, v in enumerate(window[name]):
            metrics[f"monitor/{name}_s_rank{r}"] = v
    for r in sorted(r for ranks in window.get("pipelines") or () for r in ranks):
        for name in ("sendrecv", "bubble", "stage_compute", "stage_span"):
            metrics[f"monitor/{name}_s_rank{r}"] = window[name][r]
    for r, v in enumerate(window.get("exchange") or ()):
        metrics[f"monitor/exchange_s_rank{r}"] = v
    for r, v in enumerate(window.get("comm_bytes") or ()):
        if v is not None and not math.isnan(v):
            metrics[f"monitor/comm_bytes_rank{r}"] = v
    for r, v in enumerate(window["busy"]):
        metrics[f"monitor/busy_rank{r}"] = v
    for r, v in enumerate(window["solo"]):
        metrics[f"monitor/solo_samples_per_s_rank{r}"] = v
    for r, v in enumerate(window["shares"] or []):
        metrics[f"monitor/share_rank{r}"] = v
    for key in ("step_s", "samples_per_s", "tokens_per_s", "ideal_fraction", "comm_compute_ratio"):
        if window.get(key) is not None:
            metrics[f"monitor/{key}"] = window[key]
    for name, values in window["nvml"].items():
        for r, v in enumerate(values):
            if not math.isnan(v):
                metrics[f"monitor/{name}_rank{r}"] = v
    return metrics


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
