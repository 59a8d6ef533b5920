"""Does ``capacities="profile"`` measure the real speed ratio of two GPUs? (2 GPUs; rank 1 capped to 32 SMs.)

1. fit: a 2-GPU ``HeteroDDPStrategy(capacities="profile", emulate=[None, {"sm_share": sms / total}])`` run profiles
   the model before its first step (the emulation caps rank 1 with a CUDA green context) and picks a split b0 + b1;
2. solo: one process then times forward + backward of the model alone on GPU 0 (whole device) at b0 samples and on
   GPU 1 under a green context of ``--sms`` SMs at b1 samples (work on the green context's stream; autograd runs
   backward on the same stream), and at an equal split for reference.

The profiled share is right when the solo throughput ratio at the chosen split, (b0 / t0) / (b1 / t1), equals the
profiled ratio, i.e. when both devices need the same time for their shares. Prints both ratios and whether they
agree within 10 %; writes ``profile_check.json`` under ``--out`` (default ``$OUT`` or ./out).

    python benchmarks/profile_check.py --out "$OUT"
"""

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

# Per-rank batch of the equal split (global batch 2 * BATCH). Many samples through modest weights: the step is
# compute-bound, as training steps usually are (huge weights at a small batch make the slow card latency-bound).
WIDTH, DEPTH, BATCH = 2048, 6, 4096


def make_net() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(1024, WIDTH), nn.GELU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def solo_throughput(device: int, sms: int, batch: int = BATCH, steps: int = 20) -> float:
    """Samples/s of forward + backward at ``batch`` samples, alone on ``device`` (``sms``: green-context cap)."""
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = make_net().cuda(device)
    x = torch.randn(batch, 1024, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    stream_ctx: Any = nullcontext()
    if sms:
        stream = _green_stream(device, sms)
        stream.wait_stream(torch.cuda.current_stream(device))
        stream_ctx = torch.cuda.stream(stream)
    times: list[float] = []
    with stream_ctx:
        warm_until = time.perf_counter() + 0.5  # clocks ramp up from idle, as in the profiler
        i = 0
        while len(times) < steps:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            net.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            i += 1
            if i > 3 and time.perf_counter() > warm_until:
                times.append(time.perf_counter() - t0)
    return batch / sorted(times)[len(times) // 2]


_GREEN: dict[tuple[int, int], Any] = {}


def _green_stream(device: int, sms: int) -> torch.cuda.Stream:
    """One green context per (device, SM count) for the whole process: each solo measurement reuses it."""
    if (device, sms) not in _GREEN:
        from torch.cuda.green_contexts import GreenContext

        _GREEN[(device, sms)] = GreenContext.create(num_sms=sms, device_id=device)
    return _GREEN[(device, sms)].Stream()


def fit_phase(sms: int, out: str) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroDDPStrategy

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(8 * BATCH, 1024, generator=g), torch.randint(0, 10, (8 * BATCH,), generator=g))
            return DataLoader(data, batch_size=BATCH, shuffle=True)

    total = torch.cuda.get_device_properties(0).multi_processor_count
    strategy = HeteroDDPStrategy(capacities="profile", emulate=[None, {"sm_share": sms / total}], profile_steps=6)
    trainer = Trainer(accelerator="gpu", devices=2, strategy=strategy, precision="bf16-mixed", max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Model())
    if trainer.global_rank == 0:
        profile = strategy.share_controller.profile
        with open(os.path.join(out, "profile_fit.json"), "w") as f:
            json.dump({"capacities": list(profile.capacities), "caps": profile.caps, "cost_s": profile.cost_s,
                       "split": list(strategy.plan.split), "ranks": profile.state_dict()["ranks"],
                       "table": strategy.lab.table(strategy.plan)}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--sms", type=int, default=32)
    parser.add_argument("--phase", choices=["all", "fit"], default="all")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.phase == "fit":
        fit_phase(args.sms, args.out)
        return
    if torch.cuda.device_count() < 2:
        sys.exit("profile_check needs 2 GPUs")
    # The Lightning run re-executes this script per rank (popen launcher): run it as its own command.
    subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", "fit", "--out", args.out, "--sms",
                    str(args.sms)], check=True)
    with open(os.path.join(args.out, "profile_fit.json")) as f:
        fit = json.load(f)
    b0, b1 = fit["split"]
    equal = [solo_throughput(0, 0), solo_throughput(1, args.sms)]
    solo = [solo_throughput(0, 0, b0), solo_throughput(1, args.sms, b1)]
    solo_ratio = solo[0] / solo[1]
    profiled_ratio = fit["capacities"][0] / fit["capacities"][1]
    step_ms = [1e3 * b0 / solo[0], 1e3 * b1 / solo[1]]
    agree = abs(profiled_ratio / solo_ratio - 1) <= 0.10
    result = {"solo_samples_per_s_at_split": solo, "solo_ratio_at_split": solo_ratio,
              "solo_step_ms_at_split": step_ms, "solo_samples_per_s_equal_batch": equal,
              "profiled_samples_per_s": fit["capacities"], "profiled_ratio": profiled_ratio,
              "agree_within_10pct": agree, "profile_cost_s": fit["cost_s"], "split": fit["split"],
              "mem_caps": fit["caps"], "sms_rank1": args.sms, "device": torch.cuda.get_device_name(0),
              "emulated": True}
    with open(os.path.join(args.out, "profile_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(fit["table"])
    print(f"{'':34}{'rank 0':>12}{'rank 1':>12}{'ratio':>8}")
    print(f"{'solo samples/s, equal batch ' + str(BATCH):34}{equal[0]:>12.0f}{equal[1]:>12.0f}"
          f"{equal[0] / equal[1]:>8.2f}")
    print(f"{'solo samples/s at split':34}{solo[0]:>12.0f}{solo[1]:>12.0f}{solo_ratio:>8.2f}")
    print(f"{'solo step ms at split':34}{step_ms[0]:>12.2f}{step_ms[1]:>12.2f}{step_ms[0] / step_ms[1]:>8.2f}")
    print(f"{'profiled samples/s':34}{fit['capacities'][0]:>12.0f}{fit['capacities'][1]:>12.0f}{profiled_ratio:>8.2f}")
    print(f"split {fit['split']}, mem caps {fit['caps']}, profiling {fit['cost_s']:.2f} s; "
          f"agree within 10%: {'YES' if agree else 'NO'}")


if __name__ == "__main__":
    main()
