"""Does ``capacities="profile"`` measure the real speed ratio of two GPUs? (2 GPUs; rank 1 capped to 32 SMs.)

1. solo: one process times forward + backward of the model alone on GPU 0 (whole device) and on GPU 1 under a CUDA
   green context of ``--sms`` SMs (work on the green context's stream; autograd runs backward on the same stream);
2. fit: a 2-GPU ``HeteroDDPStrategy(capacities="profile", emulate=[None, {"sm_share": sms / total}])`` run profiles
   the model before its first step (the emulation caps rank 1 with the same green-context mechanism).

Prints both ratios and whether they agree within 10 %; writes ``profile_check.json`` under ``--out``
(default ``$OUT`` or ./out).

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

WIDTH, DEPTH, BATCH = 4096, 6, 512  # per-rank batch of the equal split; global batch 2 * BATCH


def make_net() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(1024, WIDTH), nn.GELU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def solo_throughput(device: int, sms: int, steps: int = 20) -> float:
    """Samples/s of forward + backward at the profiled batch size, alone on ``device``."""
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = make_net().cuda(device)
    x = torch.randn(BATCH, 1024, device=device)
    y = torch.randint(0, 10, (BATCH,), device=device)
    stream_ctx: Any = nullcontext()
    if sms:
        from torch.cuda.green_contexts import GreenContext

        green = GreenContext.create(num_sms=sms, device_id=device)
        stream = green.Stream()
        stream.wait_stream(torch.cuda.current_stream(device))
        stream_ctx = torch.cuda.stream(stream)
    times = []
    with stream_ctx:
        for i in range(steps + 3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            net.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return BATCH / sorted(times)[len(times) // 2]


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
                       "split": list(strategy.lab.split), "ranks": profile.state_dict()["ranks"],
                       "table": strategy.lab.table()}, f, indent=1)


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
    solo = [solo_throughput(0, 0), solo_throughput(1, args.sms)]
    # The Lightning run re-executes this script per rank (popen launcher): run it as its own command.
    subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", "fit", "--out", args.out, "--sms",
                    str(args.sms)], check=True)
    with open(os.path.join(args.out, "profile_fit.json")) as f:
        fit = json.load(f)
    solo_ratio = solo[0] / solo[1]
    profiled_ratio = fit["capacities"][0] / fit["capacities"][1]
    agree = abs(profiled_ratio / solo_ratio - 1) <= 0.10
    result = {"solo_samples_per_s": solo, "solo_ratio": solo_ratio, "profiled_samples_per_s": fit["capacities"],
              "profiled_ratio": profiled_ratio, "agree_within_10pct": agree, "profile_cost_s": fit["cost_s"],
              "split": fit["split"], "mem_caps": fit["caps"], "sms_rank1": args.sms}
    with open(os.path.join(args.out, "profile_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(fit["table"])
    print(f"{'':22}{'rank 0':>12}{'rank 1':>12}{'ratio':>8}")
    print(f"{'solo samples/s':22}{solo[0]:>12.0f}{solo[1]:>12.0f}{solo_ratio:>8.2f}")
    print(f"{'profiled samples/s':22}{fit['capacities'][0]:>12.0f}{fit['capacities'][1]:>12.0f}{profiled_ratio:>8.2f}")
    print(f"split {fit['split']}, mem caps {fit['caps']}, profiling {fit['cost_s']:.2f} s; "
          f"agree within 10%: {'YES' if agree else 'NO'}")


if __name__ == "__main__":
    main()
