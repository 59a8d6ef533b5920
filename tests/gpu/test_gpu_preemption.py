"""The pre-emption check on CUDA never waits for the step it was queued behind:
``python -m pytest -q tests/gpu/test_gpu_preemption.py -m gpu`` (skipped without a CUDA device).

A kernel of about half a second is queued, then the handler's per-step agreement runs (an NCCL group of one process, the trainer
claiming two ranks): it must return at once, and the notes it queued are read at the next call. The check before
read its notes with ``.tolist()`` at once, a host wait for the whole queue.
"""

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port

pytestmark = pytest.mark.gpu(1)


def _queued_kernel(seconds: float) -> None:
    # A spin of about `seconds` at up to 2 GHz (the test checks its real length with events).
    torch.cuda._sleep(int(seconds * 2e9))


def test_the_agreement_returns_without_waiting_for_queued_work_and_reads_a_step_later() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_hetero.resilience.preemption import PreemptionHandler

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=LightningEnvironment(), root_device=device),
                              global_step=0, global_rank=0, world_size=2, is_global_zero=True,
                              checkpoint_callbacks=[])
    handler = PreemptionHandler()
    handler.on_train_start(trainer, None)
    try:
        assert handler.agree(trainer) is None  # warm-up: the communicator exists now
        torch.cuda.synchronize(device)
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        _queued_kernel(0.5)
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        os.kill(os.getpid(), signal.SIGTERM)  # noted by the handler: this process goes on
        host = time.perf_counter()
        first = handler.agree(trainer)  # this step's notes go on the stream behind the kernel
        host = time.perf_counter() - host
        second = handler.agree(trainer)  # the next step reads them
        torch.cuda.synchronize(device)
    finally:
        handler.uninstall()
        dist.destroy_process_group()
    assert began.elapsed_time(ended) > 200.0  # the kernel was long
    assert host < 0.1, f"the agreement waited {host:.3f} s for the queued kernel"
    assert first is None and second == int(signal.SIGTERM)
