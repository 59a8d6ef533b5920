"""Emulate a mixed lab on identical GPUs (or on CPU), to develop and benchmark without owning the cards.

Every rank gets a profile: a preset name (``"RTX3090"``, ``"A100-40GB"``, ...), a dict, or ``None`` (the real
device, unchanged). On CUDA a profile applies:

- **compute**: a CUDA green context with a share of the host's SMs. Only kernels launched on the green context's
  stream are capped, so the strategy runs every training/validation/test/predict step and every optimizer step
  (whose closure runs forward and backward) with that stream as the current stream; autograd runs each backward op
  on its forward op's stream, so backward is capped too. NCCL launches its kernels on its own streams: collectives
  are *not* capped (a real slow card's NCCL kernels would also be slower, but they are memory-bound, not SM-bound).
  Work outside the steps (the batch copy, logging reductions, callbacks) is not capped either.
- **memory**: ``torch.cuda.set_per_process_memory_fraction`` caps PyTorch's caching allocator (the CUDA context and
  NCCL's buffers are outside it).
- **name and compute capability**: the ``LIGHTNING_HETERO_DEVICE_NAME`` / ``LIGHTNING_HETERO_CAPABILITY`` overrides
  that :mod:`lightning_hetero.lab.devices` reads, so the lab table, ``capacities="peak"`` and the precision policy see
  the emulated card (a ``(7, 0)`` capability makes the policy take the fp16 path on bf16 hardware).
- **link**: the slowest link class of the job, through NCCL's environment before the process group exists
  (``"pcie"``: no peer-to-peer, ≈ 25 GB/s on an H200 host; ``"ethernet"``: no P2P and no shared memory, ≈ 2.6 GB/s).
- **host** (``{"host": "ws1"}``): the rank reports that host name (``LIGHTNING_HETERO_HOST``: host groups, leaders and
  the lab table follow it) and NCCL gets ``NCCL_HOSTID`` before the process group exists, so NCCL treats the emulated
  hosts as separate machines: peer-to-peer / shared memory inside a host, its network transport (TCP sockets over
  loopback: ``NCCL_IB_DISABLE=1``, ``NCCL_SOCKET_IFNAME=lo`` unless set) between hosts. With emulated hosts,
  ``link: "ethernet"`` names the link *between* hosts and leaves the transport inside each host alone.
- **inter-host bandwidth** (``{"inter_host_gbit": 10}``): the hop between hosts is *paced*, not throttled: the
  gradient exchange between hosts still runs at the machine's speed, then the hook holds the step until a link of
  that many Gbit/s would have delivered the same bytes (see
  :class:`~lightning_hetero.lab.link_pacing.LinkPacer`; the job uses the lowest value of any
  rank). Transfers overlap the backward pass as they would on a real link; the time a real NIC's protocol stack
  would add is not modelled. Works on CPU (gloo) too.

On CPU a profile's ``slowdown`` pauses the rank after each step (:mod:`lightning_hetero.lab.step_slowdown`), and
``Emulator.throttle(factor)`` slows a rank mid-run (:mod:`lightning_hetero.lab.emulator`). How presets get their SM
count and time dilation: :mod:`lightning_hetero.lab.emulated_device`.

The layers, from the user's argument to the running rank (each module imports only those before it):

- :mod:`lightning_hetero.lab.presets`: the cards known by name, the link classes;
- :mod:`lightning_hetero.lab.emulation_spec`: the ``emulate`` argument validated, one :class:`EmulationSpec` per rank;
- :mod:`lightning_hetero.lab.emulated_device`: a spec resolved on the host device (SM count, dilation, memory cap);
- :mod:`lightning_hetero.lab.emulation_env`: the job's link class and emulated hosts as NCCL's environment;
- :mod:`lightning_hetero.lab.green_context`, :mod:`lightning_hetero.lab.dilation`,
  :mod:`lightning_hetero.lab.step_slowdown`: a step on a share of the SMs, its GPU idle after, its CPU pause after;
- :mod:`lightning_hetero.lab.emulator`: one rank's :class:`Emulator`, around every step;
- this module: :func:`start_emulation`, what the lab set-up calls, and :func:`lab_warning`, rank 0's notice.

Example::

    from lightning.pytorch import Trainer
    from lightning_hetero import HeteroDDPStrategy

    # two H200s pretending to be an A100 and an RTX 3090 on a PCIe link
    strategy = HeteroDDPStrategy(capacities="peak", emulate=["A100-40GB", "RTX3090"])
    Trainer(accelerator="gpu", devices=2, strategy=strategy).fit(model)

    # a custom profile: a quarter of the SMs, 24 GiB, PCIe-class link
    HeteroDDPStrategy(emulate=[None, {"sm_share": 0.25, "memory_gib": 24, "link": "pcie"}])
"""

import warnings
from collections.abc import Sequence
from typing import Optional

import torch

from lightning_hetero.lab.devices import DeviceInfo
from lightning_hetero.lab.emulated_device import resolve
from lightning_hetero.lab.emulation_env import emulates_hosts, job_inter_host_gbit, job_link_class
from lightning_hetero.lab.emulation_spec import EmulationSpec
from lightning_hetero.lab.emulator import Emulator


def start_emulation(
    specs: Sequence[Optional[EmulationSpec]], rank: int, world_size: int, host: DeviceInfo, root_device: torch.device
) -> Optional[Emulator]:
    """This rank's emulator with its environment applied, or ``None`` when its entry is ``None``.

    Every rank must call it with the same ``specs`` (the NCCL link settings are derived from all of them).
    """
    if len(specs) != world_size:
        raise ValueError(f"`emulate` has {len(specs)} entries but the job has {world_size} ranks: give one per rank.")
    link = job_link_class(specs)
    hosts = emulates_hosts(specs)
    spec = specs[rank]
    if spec is None:
        if not hosts and (root_device.type != "cuda" or link == "nvlink"):
            return None
        spec = EmulationSpec(name=host.name, link=link)  # the real card, but on the job's emulated link / hosts
    device = resolve(spec, host, specs)
    if device.calibration.startswith("published ratio"):
        warnings.warn(f"Emulating {spec.preset} on {host.name}: {device.calibration} "
                      "(benchmarks/calibrate_presets.py measures one).")
    emulator = Emulator(device, root_device, link, hosts=hosts, inter_host_gbit=job_inter_host_gbit(specs))
    emulator.apply_env()
    return emulator


def lab_warning(strategy_name: str, device_type: str, summaries: Sequence[str]) -> str:
    """The rank-0 notice that the numbers come from an emulation, naming the running strategy and only what the
    emulation does on ``device_type`` ("cuda": green-context SM caps, memory caps, NCCL link classes; otherwise:
    pauses that slow each rank's CPU steps, the link between ranks not emulated).

    Example::
        >>> lab_warning("HeteroFSDPStrategy", "cpu", ["slowdown 3.00x, gloo (link not emulated)", "real device"])
    """
    if device_type == "cuda":
        how = ("SM shares are green-context caps on the host GPU (with a time dilation after each step where the "
               "calibration asks for one), memory a cap on its allocator, links NCCL's transport settings; NCCL "
               "kernels are not capped")
    else:
        how = ("a rank's slowdown is a pause of (slowdown - 1) x its step's CPU time; the link between ranks is not "
               "emulated")
    lines = [f"  rank {r}: {s}" for r, s in enumerate(summaries)]
    return (
        f"{strategy_name} is EMULATING a mixed lab on {device_type.upper()}: device names, memory and speed below are "
        f"imposed on the host device ({how}). Timings are not those of real cards.\n" + "\n".join(lines)
    )