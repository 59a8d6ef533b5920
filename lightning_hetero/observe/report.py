"""``python -m lightning_hetero report LOGDIR``: a PNG of where every rank's time went, from a monitored run.

Reads the ``hetero_monitor.jsonl`` that :class:`~lightning_hetero.observe.monitor.HeteroMonitor` writes into the
logger's ``log_dir`` (the newest one under ``LOGDIR``; one JSON object per logged window) and draws, with matplotlib:

- per rank, the timeline of a step: compute, wait for other ranks, data loading and exposed communication (ms per
  step, stacked, against the optimizer step); a pipeline's stage rank, titled by its pipeline and stage, also its
  send/recv and bubble; under a timed gradient exchange (the hybrid layout's stage exchange) a dashed line of the
  rank's time blocked in it (a part of its comm and wait), and in the title the bytes it handed to the step's
  gradient collectives, where the strategy counts them;
- the share of the global batch each rank trained on (changes when ``rebalance=True`` moves it);
- each rank's solo rate (samples per second of compute), where a card slowing down mid-run (thermal throttling, a
  co-tenant) shows up, with the GPU temperature and SM clock beside it when NVML was available.

Example::

    python -m lightning_hetero report lightning_logs/            # -> lightning_logs/version_0/hetero_monitor.png
"""

import glob
import json
import math
import os
from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.observe.monitor import SIDECAR
from lightning_hetero.observe.stage_times import stage_names

_PARTS = (("compute", "tab:green"), ("wait", "tab:red"), ("data", "tab:orange"), ("comm", "tab:blue"))
_STAGE_PARTS = (("sendrecv", "tab:cyan"), ("bubble", "tab:gray"))


def find_sidecar(logdir: str) -> str:
    """The newest monitor file at or under ``logdir``; ``FileNotFoundError`` saying what to do otherwise."""
    if os.path.isfile(logdir):
        return logdir
    found = glob.glob(os.path.join(logdir, "**", SIDECAR), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no {SIDECAR} under {logdir!r}: train with the strategy's `observation={{'monitor': True}}` or "
            "`callbacks=[HeteroMonitor()]` "
            "and pass the logger's directory (e.g. lightning_logs/)."
        )
    return max(found, key=os.path.getmtime)


def load_windows(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        windows = [json.loads(line) for line in f if line.strip()]
    if not windows:
        raise ValueError(f"{path} holds no logged window yet (the first is written after `log_every_n_steps` steps).")
    return windows


def draw(windows: Sequence[dict[str, Any]], out: str) -> str:
    """Write the PNG to ``out`` and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = len(windows[0]["compute"])
    steps = [w["step"] for w in windows]
    # Each window covers (first_step, step]: drawn as steps that hold its value back to where it began.
    edges = [windows[0].get("first_step", steps[0])] + steps

    def held(values: list) -> list:
        return values[:1] + values
    fig, axes = plt.subplots(world + 2, 1, figsize=(10, 2.2 * (world + 2)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    names = stage_names(windows[-1].get("pipelines"))
    parts = _PARTS + (_STAGE_PARTS if names else ())
    for r in range(world):
        ax = axes[r]
        layers = [held([1000 * (w.get(name) or [0.0] * world)[r] for w in windows]) for name, _ in parts]
        ax.stackplot(edges, *layers, labels=[name for name, _ in parts], colors=[c for _, c in parts], step="pre")
        if any(w.get("exchange") for w in windows):
            ax.step(edges, held([1000 * (w.get("exchange") or [0.0] * world)[r] for w in windows]), where="pre",
                    color="black", linestyle="--", linewidth=1, label="exchange")
        share = windows[-1].get("shares")
        title = f"rank {r}" + (f", {names[r]}" if r in names else "") + (f" (share {share[r]:.1%})" if share else "")
        sent = (windows[-1].get("comm_bytes") or [None] * world)[r]
        title += f", {sent / 1e6:.4g} MB / step exchanged" if sent is not None and not math.isnan(sent) else ""
        ax.set_title(title, loc="left", fontsize=9)
        ax.set_ylabel("ms / step")
        if r == 0:
            ax.legend(loc="upper right", fontsize=8, ncol=len(parts) + 1)
    ax = axes[world]
    if any(w.get("shares") for w in windows):
        for r in range(world):
            ax.step(edges, held([100 * (w.get("shares") or [float("nan")] * world)[r] for w in windows]), where="pre",
                    label=f"rank {r}")
        ax.legend(loc="upper right", fontsize=8, ncol=min(world, 8))
    ax.set_ylabel("share %")
    ax.set_title("share of the global batch", loc="left", fontsize=9)
    ax = axes[world + 1]
    for r in range(world):
        ax.plot(steps, [w["solo"][r] for w in windows], label=f"rank {r}")
    ax.set_ylabel("samples/s")
    ax.set_title("solo rate (samples per second of compute)", loc="left", fontsize=9)
    ax.legend(loc="upper left", fontsize=8, ncol=min(world, 8))
    temps = _series(windows, "temp_c")
    if temps is not None:
        twin = ax.twinx()
        for r in range(world):
            twin.plot(steps, temps[r], linestyle=":", linewidth=1)
        twin.set_ylabel("GPU °C (dotted)")
    axes[-1].set_xlabel("optimizer step")
    last = windows[-1]
    fraction = last.get("ideal_fraction")
    span = f"steps {last.get('first_step', 0) + 1}-{last['step']}"
    fig.suptitle(  # the last window's figures, said as such: the end-of-fit table gives all steps' means
        f"HeteroMonitor, last window ({span}): {last['samples_per_s']:.4g} samples/s"
        + (f", {fraction:.0%} of ideal" if fraction is not None else "")
        + (f", exposed comm / compute {last['comm_compute_ratio']:.2f}" if last.get("comm_compute_ratio") is not None
           else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _series(windows: Sequence[dict[str, Any]], name: str) -> Optional[list[list[float]]]:
    world = len(windows[0]["compute"])
    values = [[(w.get("nvml", {}).get(name) or [None] * world)[r] for w in windows] for r in range(world)]
    if all(v is None for row in values for v in row):
        return None
    return [[float("nan") if v is None else v for v in row] for row in values]


def main(logdir: str, out: Optional[str] = None) -> str:
    path = find_sidecar(logdir)
    target = out or os.path.join(os.path.dirname(path), "hetero_monitor.png")
    draw(load_windows(path), target)
    print(f"wrote {target}")
    return target
