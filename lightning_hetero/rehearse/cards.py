"""The lab to rehearse, as ``--lab`` gives it: its cards (preset names or profiles) and their labels."""

import json
from typing import Any

from lightning_hetero.lab.emulation_spec import parse_emulate
from lightning_hetero.lab.presets import PRESETS, preset_tflops
from lightning_hetero.plan.layout_choice import Card


def parse_lab(text: str) -> list[Any]:
    """``"A100-80GB,RTX3090,RTX3090"`` (preset names) or a JSON list of names / profile dicts; ``ValueError`` naming
    ``--lab`` otherwise."""
    text = text.strip()
    if text.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"`--lab`={text!r} is not a JSON list: {err}.") from None
    else:
        entries = [name.strip() for name in text.split(",") if name.strip()]
    if not isinstance(entries, list) or len(entries) < 2:
        raise ValueError(f"`--lab`={text!r} must name at least two cards, e.g. 'A100-80GB,RTX3090,RTX3090' "
                         f"(presets: {sorted(PRESETS)}) or a JSON list of profiles.")
    if any(entry is None for entry in entries):
        raise ValueError("`--lab` entries must be cards (a preset or a profile dict), not null.")
    parse_emulate(entries, name="--lab")
    return entries


def card_label(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    return str(entry.get("preset") or entry.get("name") or "custom")


def lab_cards(text: str) -> list[Card]:
    """The ``--lab`` cards as :func:`~lightning_hetero.plan.layout_choice.compare_layouts` reads them: each preset's
    memory (a profile's ``memory_gib`` overrides it), published rate as its speed and link class."""
    cards = []
    for entry in parse_lab(text):
        preset_name = entry if isinstance(entry, str) else entry.get("preset")
        if preset_name is None:
            raise ValueError(f"`--lab` card {entry!r}: comparing layouts needs a preset (its memory and rate).")
        preset = PRESETS[preset_name]
        gib = preset.memory_gib if isinstance(entry, str) or entry.get("memory_gib") is None else entry["memory_gib"]
        cards.append(Card(card_label(entry), int(gib * 2**30), preset_tflops(preset),
                          entry.get("link") or preset.link if isinstance(entry, dict) else preset.link))
    return cards
