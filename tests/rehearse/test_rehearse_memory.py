"""A rehearsed sharded rank holds what the real rank holds: the CPU tensor bytes alive in a rank rehearsed on the
fake process group equal those of the same rank of the same job really run (two processes, gloo), at the start of
a step and after its backward. A whole-model copy kept only by the rehearsal (issue 37: rehearsed FSDP peaks one
fp32 model above the real run) would show here as the model's bytes on both ranks."""

import json
import os
import subprocess
import sys

import pytest

from lightning_hetero.rehearse.job import RankJob
from lightning_hetero.rehearse.launch import free_port, rank_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "rehearse", "_census_rank.py")
LAB = ["A100-80GB", "RTX3090"]
# A GPT of 0.4M parameters (1.7 MB in fp32): a copy of it is 7 % of a rank's live bytes (its shards, their
# gradients and AdamW's two states come to about 2 x 1.7 MB per rank).
CONFIG = """seed_everything: 0
model:
  class_path: benchmarks.lm.GPTModule
  init_args: {vocab: 256, seq: 32, width: 96, layers: 3, heads: 2}
data:
  class_path: benchmarks.lm.RandomTokens
  init_args: {batch_size: 4, seq: 32, vocab: 256, samples: 64}
trainer:
  strategy:
    class_path: lightning_hetero.HeteroFSDPStrategy
    init_args: {capacities: [3, 1], global_batch_size: 8, memory: keep}
"""
# Rehearsed and real live bytes agree within this fraction (the model's fp32 copy is about 7 %).
MARGIN = 0.01


def _start(job: RankJob, env: dict[str, str]) -> subprocess.Popen:
    from dataclasses import asdict

    return subprocess.Popen([sys.executable, WORKER, json.dumps(asdict(job))], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(job.out + ".log", "w"))


@pytest.mark.slow
def test_a_rehearsed_sharded_rank_holds_what_the_real_rank_holds(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG)
    env_extra = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                 "OMP_NUM_THREADS": "1"}
    port = free_port()
    jobs = [RankJob(str(config), mode, r, LAB, 4, str(tmp_path / f"{mode}{r}.json"),
                    "lightning_hetero.HeteroFSDPStrategy", "cpu", port=port)
            for mode in ("hetero", "real") for r in range(len(LAB))]
    processes = [_start(job, {**rank_environment(job), **env_extra}) for job in jobs]
    try:
        for process in processes:
            process.wait(timeout=400)
    finally:
        for process in processes:
            process.kill()
    census = {}
    for job in jobs:
        path = job.out + ".census"
        assert os.path.exists(path), open(job.out + ".log").read()[-3000:]
        with open(path) as f:
            census[job.mode, job.rank] = json.load(f)
        assert census[job.mode, job.rank]["ok"], census[job.mode, job.rank]["error"]
    for r in range(len(LAB)):
        rehearsed, real = census["hetero", r], census["real", r]
        assert rehearsed["split"] == real["split"] == [6, 2]
        for point in ("step_start", "before_optimizer_step"):
            assert real[point] > 0
            assert abs(rehearsed[point] - real[point]) <= MARGIN * real[point], (r, point, rehearsed, real)
