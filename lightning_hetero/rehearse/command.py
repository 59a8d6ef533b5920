"""``doctor --model CONFIG --lab "A100-80GB,RTX3090,RTX3090"``: rehearse a lab nobody here owns, one rank at a time.

Each target rank runs the config's real training step (its LightningModule, data, ``Trainer`` and strategy, with the
strategy's own sharding, precision and memory plan) alone on this machine's device, as rank ``r`` of an ``N``-rank
job whose collectives are stood in for by torch's fake process group, in a fresh process capped to that card's
memory (and, on CUDA, to its SM share through a green context; on CPU through the emulator's slowdown). The same is
done for Lightning's ``DDPStrategy`` and ``FSDPStrategy`` with equal batches. What comes out:

- **measured**: each rank's peak device memory, its step time under the card's compute share (and its phases:
  forward, backward, optimizer step), the plan and batch share the strategy chose (from the lab's cards, as the
  real lab would);
- **predicted**: the step time of the job (the ranks' phases composed with the modelled communication of the
  gradient path over the lab's link class), throughput and its ratio to the sum of the cards' solo rates.

The hybrid layout (``HeteroHybridStrategy``), whose stage ranks pass activations to each other, is rehearsed with
the lab's ranks together on this device instead (:mod:`~lightning_hetero.rehearse.together`): memory and the plan,
no step time.

Example::

    python -m lightning_hetero doctor --model configs/rehearse_gpt.yaml --lab "A100-80GB,RTX3090,RTX3090"
"""

import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Optional, TextIO

import torch

from lightning_hetero.lab.emulation_env import job_link_class
from lightning_hetero.lab.emulation_spec import EmulationSpec, parse_emulate
from lightning_hetero.registry import entry, names
from lightning_hetero.rehearse.advice import advise
from lightning_hetero.rehearse.cards import card_label, parse_lab
from lightning_hetero.rehearse.job import WARMUP_STEPS, RankJob, RankResult
from lightning_hetero.rehearse.launch import launch_rank
from lightning_hetero.rehearse.layouts import rehearsed_layouts
from lightning_hetero.rehearse.notes import notes, uneven_twins
from lightning_hetero.rehearse.predict import predict
from lightning_hetero.rehearse.report import ASSUMPTIONS, draw, format_rehearsal
from lightning_hetero.rehearse.together import ASSUMPTIONS as TOGETHER_ASSUMPTIONS
from lightning_hetero.rehearse.together import (
    NOT_PREDICTED,
    first_failure,
    format_together,
    is_hybrid,
    pipelines_asked,
    run_together,
    together_notes,
)


def rehearse(config: str, lab_text: str, strategy: Optional[str] = None, steps: int = 6, out_dir: Optional[str] = None,
             baselines: bool = True, timeout: float = 900.0, accelerator: Optional[str] = None,
             script: Optional[str] = None, stream: Optional[TextIO] = None) -> dict[str, Any]:
    """Rehearse ``config`` on the lab ``lab_text``; writes ``rehearsal.log``, ``.json`` and ``.png`` to ``out_dir``
    and returns the report, whose ``"failed"`` says why when a rank of ours could not run (other than out of
    memory on its card: the baselines are then not rehearsed). ``script``: the user's LightningCLI script the config
    belongs to; ``stream``: where the progress and the tables go (default stdout)."""
    stream = stream or sys.stdout
    if not os.path.isfile(config):
        raise ValueError(f"`--model`={config!r} is not a file.")
    if script is not None and not os.path.isfile(script):
        raise ValueError(f"`--script`={script!r} is not a file.")
    if strategy is not None and strategy not in names():
        raise ValueError(f"`--strategy`={strategy!r} must be one of {sorted(names())}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < WARMUP_STEPS + 2:
        raise ValueError(f"`--steps`={steps!r} must be an integer >= {WARMUP_STEPS + 2}.")
    lab = parse_lab(lab_text)
    accelerator = accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    out_dir = out_dir or f"rehearsal-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(out_dir, exist_ok=True)
    specs: list[Optional[EmulationSpec]] = list(parse_emulate(lab) or ())
    link = job_link_class(specs)
    report: dict[str, Any] = {
        "config": config, "script": script, "lab_text": lab_text, "lab": lab, "strategy": strategy or "the config's",
        "steps": steps, "accelerator": accelerator,
        "local_device": torch.cuda.get_device_name(0) if accelerator == "gpu" else "cpu",
        "hetero": [], "ddp": [], "fsdp": [], "notes": [], "warnings": [], "assumptions": list(ASSUMPTIONS),
        "failed": None,
    }
    log_path = os.path.join(out_dir, "rehearsal.log")
    # A SIGTERM (a scheduler's timeout) unwinds like Ctrl-C, so the ranks' process groups are killed on the way out.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if is_hybrid(config, strategy):
        with tempfile.TemporaryDirectory(prefix="hetero-rehearse-") as scratch, open(log_path, "w") as log:
            results = run_together(config, lab, steps, scratch, log, timeout, entry(strategy).class_path if strategy
                                   else None, accelerator, script, stream)
        first = first_failure(results)
        report.update(hetero=[asdict(r) for r in results], pipelines_asked=pipelines_asked(config),
                      failed=failure([asdict(first)], log_path, script) if first else None,
                      prediction={"step_seconds": None, "why": NOT_PREDICTED}, advice=None,
                      assumptions=list(TOGETHER_ASSUMPTIONS), notes=together_notes(results, accelerator))
        return _written(report, format_together(report), out_dir, log_path, stream)
    with tempfile.TemporaryDirectory(prefix="hetero-rehearse-") as scratch, open(log_path, "w") as log:
        modes = ("hetero", "ddp", "fsdp") if baselines else ("hetero",)
        if accelerator != "gpu":
            # Lightning's FSDPStrategy runs on CUDA only.
            modes = tuple(m for m in modes if m != "fsdp")
            report["notes"].append("Lightning FSDPStrategy not rehearsed: it needs a CUDA device")
        for mode in modes:
            for rank in range(len(lab)):
                job = RankJob(config=config, mode=mode, rank=rank, lab=lab, steps=steps,
                              out=os.path.join(scratch, f"{mode}-rank{rank}.json"),
                              strategy=entry(strategy).class_path if strategy else None, accelerator=accelerator,
                              script=script)
                log.write(f"\n===== {mode} rank {rank} ({card_label(lab[rank])}) =====\n")
                log.flush()
                result = launch_rank(job, timeout, log)
                report[mode].append(asdict(result))
                print(f"  rehearsed {mode:<6} rank {rank} ({result.card}): "
                      f"{'ok' if result.ok else 'OOM' if result.oom else result.error}", file=stream, flush=True)
                if mode == "hetero" and rank == 0 and result.error and not result.oom:
                    # The job itself is broken (config, model): every rank would say the same.
                    break
            report["failed"] = report["failed"] or failure(report["hetero"], log_path, script)
            if report["failed"]:
                # Lightning's strategies would only repeat the job's own error.
                break
    hetero = [RankResult(**r) for r in report["hetero"]]
    report["prediction"] = predict(hetero, [RankResult(**r) for r in report["ddp"]],
                                   [RankResult(**r) for r in report["fsdp"]], strategy or "", link)
    report["notes"] += notes(hetero, accelerator, report["prediction"])
    report["warnings"] += uneven_twins(hetero)
    report["advice"] = advise(hetero, sharded=any(r.memory_modes for r in hetero))
    report["layouts"] = rehearsed_layouts(hetero, lab)
    layouts = ("\n\nEvery layout, the fastest cards alone included (from the ranks measured here):\n"
               + report["layouts"]["text"]) if report["layouts"] else ""
    return _written(report, format_rehearsal(report) + layouts, out_dir, log_path, stream)


def _written(report: dict[str, Any], text: str, out_dir: str, log_path: str, stream: TextIO) -> dict[str, Any]:
    """``report`` and its ``text`` written to ``out_dir`` (and the text to ``stream`` unless a rank failed)."""
    with open(log_path, "a") as log:
        log.write("\n" + text + "\n")
    with open(os.path.join(out_dir, "rehearsal.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot = None if report["failed"] else draw(report, os.path.join(out_dir, "rehearsal.png"))
    if not report["failed"]:
        print(text, file=stream)
    print(f"written: {log_path}, {os.path.join(out_dir, 'rehearsal.json')}" + (f", {plot}" if plot else ""),
          file=stream, flush=True)
    return report


# What jsonargparse names where the config gives the model or data no class path: the generic CLI's base classes (a
# class path of the config's own, refusing its arguments, is no sign of a config for a script of the user's).
_NO_CLASS_PATH = re.compile(r"class_path '[\w.]*\bLightning(Data)?Module'")


def failure(hetero: Sequence[dict[str, Any]], log_path: str, script: Optional[str]) -> Optional[str]:
    """Why our strategy's ranks could not run, the first rank's own error first; ``None`` when every rank ran or
    ran out of memory on its card (an answer of the rehearsal, not a failure)."""
    failed = [r for r in hetero if r["error"] and not r["oom"]]
    if not failed:
        return None
    first = failed[0]
    said = (f"{first['error']} [rehearsed rank {first['rank']}, {first['card']}; every rank's output: {log_path}; "
            "Lightning's strategies not rehearsed]")
    if script is None and _NO_CLASS_PATH.search(first["error"]):
        said += (" (a config of your own LightningCLI script, without class paths, rehearses through it: "
                 "give `--script SCRIPT`)")
    return said


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
