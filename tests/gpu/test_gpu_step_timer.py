"""StepTimer's CUDA end mark: ``python -m pytest -q tests/gpu/test_gpu_step_timer.py -m gpu`` (skipped without one).

The mark is an event recorded from autograd's end-of-backward callback. It must land after the backward's last kernel
even when the step runs on a side stream (the lab emulator's green-context stream), and before later work.
"""

import pytest
import torch

from lightning_hetero.plan.rebalance import StepTimer

pytestmark = pytest.mark.gpu(1)


def test_cuda_end_mark_closes_the_backward_on_the_stream_it_ran_on() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to(device)
    x = torch.randn(2048, 4096, device=device)
    timer = StepTimer(device)
    side = torch.cuda.Stream(device)
    for _ in range(4):  # the last repeat is measured
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.default_stream(device))
            timer.start()
            loss = model(x).square().mean()
            began = torch.cuda.Event(enable_timing=True)
            began.record()
            timer.watch(loss)
            loss.backward()
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            torch.cuda._sleep(50_000_000)  # later work on the same stream (tens of ms): not part of the backward
            later = torch.cuda.Event(enable_timing=True)
            later.record()
        torch.cuda.synchronize(device)
    end = timer.end_mark()
    backward_ms = began.elapsed_time(after)
    to_end_ms = began.elapsed_time(end)
    assert backward_ms > 1.0 and after.elapsed_time(later) > 5.0
    # The mark closes the backward (not a point inside it on another stream) and precedes the later work.
    assert 0.98 * backward_ms <= to_end_ms <= backward_ms + 0.05, (to_end_ms, backward_ms)


def test_monitor_end_mark_closes_the_backward_on_the_emulated_stream(tmp_path) -> None:
    """One GPU, a quarter of its SMs (green-context stream): one device trains without DDP, so no comm hook runs and
    the end mark comes from the monitor's hook on the loss, recorded from autograd's engine. Marked on the wrong
    stream it would fall early and count the backward as sync."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroDDPStrategy, HeteroMonitor

    class Wide(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    monitor = HeteroMonitor(every_n_steps=10, warmup_steps=5, summary=False, warn=False)
    seen: list = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(monitor._marks_from_hook)

    data = TensorDataset(torch.randn(512 * 40, 2048))
    trainer = Trainer(accelerator="gpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      strategy=HeteroDDPStrategy(emulate=[{"sm_share": 0.25}], observation={"print_table": False}),
                      callbacks=[monitor, Probe()])
    trainer.fit(Wide(), DataLoader(data, batch_size=512))
    assert seen and not any(seen)  # no comm hook on one device
    window = monitor.windows[-1]
    compute, comm = window["compute"][0], window["comm"][0]
    print(f"\nloss-hook end mark on 1/4 SMs: compute {1e3 * compute:.2f} ms, exposed comm {1e3 * comm:.3f} ms a step")
    assert compute > 0.002 and comm < 0.1 * compute, window
