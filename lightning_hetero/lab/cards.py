"""Published end-to-end training speed of the emulator's presets: what ``capacities="peak"`` and the presets read.

Peak TFLOP/s rank cards badly for training (an RTX 3090 has 0.11 of an A100's dense bf16 rate but trains BERT-base
at 0.39 of its speed), so the presets carry measured training throughput instead, relative to an A100-80GB (SXM4),
on three workload families:

- ``"bert"``: BERT-base SQuAD fine-tuning, fp16 (Lambda, ``bert_base_squad``);
- ``"resnet"``: ResNet-50 ImageNet, AMP (Lambda, ``resnet50``);
- ``"gpt"``: a decoder language model. No end-to-end GPT-2 training figure is published across these cards; the
  closest is Lambda's Transformer-XL large fp16 (a decoder-only LM, ``transformerxllarge``).

Source: Lambda's PyTorch training benchmarks, github.com/lambdal/deeplearning-benchmark,
``pytorch/pytorch-train-throughput-fp16.csv`` (1 GPU rows; each card at its own largest batch from
``pytorch-train-bs-fp16.csv``, which favours a bigger card slightly). Cards Lambda does not list are derived
(``source`` says how). A card's default speed is the geometric mean of its three.

Example::
    >>> training_speed("RTX3090")            # geometric mean over bert, resnet, gpt
    0.459...
    >>> training_speed("RTX3090", "bert")
    0.388...
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_hetero.lab.devices import DeviceInfo, match_name, peak_tflops

WORKLOADS: tuple[str, ...] = ("bert", "resnet", "gpt")
REFERENCE = "A100-80GB"
_REFERENCE_TFLOPS = 312.0  # the reference card's dense bf16 rate, for cards without a published training speed

_LAMBDA = "lambdal/deeplearning-benchmark pytorch-train-throughput-fp16.csv"


@dataclass(frozen=True)
class CardSpeed:
    """One card's published samples/s per workload (same units as the reference card's row) and where they are from."""

    bert: float
    resnet: float
    gpt: float
    source: str

    def of(self, workload: str) -> float:
        return float(getattr(self, workload))


# Samples/s (Transformer-XL: tokens/s) of one GPU, fp16 / AMP.
_T4_FROM_V100 = math.sqrt(65.0 / 125.0 * 320.0 / 900.0)  # geometric mean of tensor-rate and bandwidth ratios: 0.43
PUBLISHED: dict[str, CardSpeed] = {
    "H100": CardSpeed(812.0, 2616.0, 30841.0, f"{_LAMBDA}: 'H100 80GB SXM5'"),
    "A100-80GB": CardSpeed(443.0, 1582.0, 17918.0, f"{_LAMBDA}: 'A100 80GB SXM4'"),
    "A100-40GB": CardSpeed(368.0, 1396.0, 16034.0,
                           f"{_LAMBDA}: 'LambdaCloud A100 40GB PCIe' (no 40GB SXM4 row; the PCIe card, 250 W)"),
    "L40S": CardSpeed(255.0, 1146.0, 16049.0,
                      f"{_LAMBDA}: 'RTX 6000 Ada' (no L40S row; the same AD102 chip with 142 SMs and 48 GB, "
                      "864 vs 960 GB/s)"),
    "A6000": CardSpeed(198.0, 916.0, 11126.0, f"{_LAMBDA}: 'RTX A6000'"),
    "RTX4090": CardSpeed(297.0, 1301.0, 14509.0, f"{_LAMBDA}: 'RTX 4090'"),
    "RTX3090": CardSpeed(172.0, 905.0, 7821.0, f"{_LAMBDA}: 'RTX 3090'"),
    "A10": CardSpeed(135.0, 638.0, 5614.0, f"{_LAMBDA}: 'LambdaCloud A10'"),
    "V100": CardSpeed(189.0, 833.0, 6071.0, f"{_LAMBDA}: 'LambdaCloud V100 16GB' (SXM2; the preset is the 32GB card)"),
    "T4": CardSpeed(189.0 * _T4_FROM_V100, 833.0 * _T4_FROM_V100, 6071.0 * _T4_FROM_V100,
                    "derived, no published row: V100's Lambda figures x sqrt(fp16 tensor 65/125 x bandwidth 320/900)"),
}
"""Published training throughput per preset (see the module docstring for the sources)."""

# Device-name substrings of the cards above, longest first when matched (real names: "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA GeForce RTX 3090", "Tesla V100-SXM2-32GB", ...).
_NAMES: dict[str, str] = {
    "H100": "H100",
    "A100-SXM4-80GB": "A100-80GB",
    "A100 80GB": "A100-80GB",
    "A100": "A100-40GB",
    "L40S": "L40S",
    "RTX 6000 Ada": "L40S",
    "A6000": "A6000",
    "RTX 4090": "RTX4090",
    "RTX 3090": "RTX3090",
    "A10": "A10",
    "V100": "V100",
    "T4": "T4",
}


def _check_workload(workload: Optional[str], where: str = "workload") -> None:
    if workload is not None and workload not in WORKLOADS:
        raise ValueError(f"`{where}`={workload!r} must be one of {WORKLOADS} (or None: the geometric mean).")


def training_speed(card: str, workload: Optional[str] = None) -> float:
    """Published training speed of preset ``card`` relative to an A100-80GB: on ``workload``, or the geometric mean of
    the three workloads when ``workload`` is ``None``."""
    if card not in PUBLISHED:
        raise ValueError(f"`card`={card!r} has no published training speed; known: {sorted(PUBLISHED)}.")
    _check_workload(workload)
    own, ref = PUBLISHED[card], PUBLISHED[REFERENCE]
    if workload is not None:
        return own.of(workload) / ref.of(workload)
    return math.exp(sum(math.log(own.of(w) / ref.of(w)) for w in WORKLOADS) / len(WORKLOADS))


def card_of(device_name: str) -> Optional[str]:
    """The preset whose published speed a device of this name has (longest name substring wins), else ``None``.

    Example::
        >>> card_of("NVIDIA A100-SXM4-80GB"), card_of("NVIDIA A10G"), card_of("NVIDIA H200")
        ('A100-80GB', 'A10', None)
    """
    key = match_name(device_name, _NAMES)
    return _NAMES[key] if key is not None else None


def device_speed(info: DeviceInfo, workload: Optional[str] = None) -> Optional[float]:
    """What ``capacities="peak"`` weighs a rank by: its card's published training speed relative to an A100-80GB; for a
    card not in :data:`PUBLISHED` (an H200, a B200, ...), its dense bf16 rate over the A100's 312 TFLOP/s, the only
    published figure that covers every card. ``None`` on CPU."""
    card = card_of(info.name)
    if info.type != "cuda":
        return None
    if card is not None:
        return training_speed(card, workload)
    rate = peak_tflops(info, torch.bfloat16)
    return None if rate is None else rate / _REFERENCE_TFLOPS
