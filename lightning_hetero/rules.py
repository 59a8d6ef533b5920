"""Per-rank rules keyed by device: the one rule language of ``capacities``, ``precision_policy`` and ``memory``.

A key is a device-name substring (case-insensitive; the longest matching key wins), ``"rank:N"`` (wins over names)
or ``"*"`` (any device, last). :class:`RankRules` checks the keys once, with the argument named, and looks a rank's
rule up.

Example::

    rules = RankRules.parse("memory", {"rank:2": "offload", "A100": "keep", "*": "auto"})
    rules.lookup(2, "NVIDIA A100-SXM4-80GB")  # 'offload'
    rules.lookup(0, "NVIDIA A100-SXM4-80GB")  # 'keep'
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

RANK_PREFIX = "rank:"
ANY_DEVICE = "*"

T = TypeVar("T")


class RankedDevice(Protocol):
    """A rank's device as a rule reads it (a :class:`~lightning_hetero.lab.devices.DeviceInfo`)."""

    @property
    def rank(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def host(self) -> str: ...


@dataclass(frozen=True)
class RankRules(Generic[T]):
    """Validated rules of one argument (``owner``), in the order given."""

    owner: str
    rules: tuple[tuple[str, T], ...]

    @classmethod
    def parse(cls, owner: str, rules: Any, check_value: Optional[Callable[[str, Any], T]] = None) -> "RankRules[T]":
        """``ValueError`` naming ``owner`` for an empty mapping or a bad key; ``check_value(key, value)`` checks (and
        may convert) each value."""
        if not isinstance(rules, Mapping) or not rules:
            raise ValueError(f"`{owner}` rules={rules!r} must be a non-empty mapping of device-name substrings, "
                             f"'rank:N' or '*' to values.")
        pairs = []
        for key, value in rules.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"`{owner}` key {key!r} must be a non-empty device-name substring, 'rank:N' or '*'.")
            if key.startswith(RANK_PREFIX) and not key[len(RANK_PREFIX):].isdigit():
                raise ValueError(f"`{owner}` key {key!r} must be 'rank:N' with N a non-negative integer.")
            pairs.append((key, check_value(key, value) if check_value is not None else value))
        return cls(owner, tuple(pairs))

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.rules]

    def lookup(self, rank: int, device_name: str) -> Optional[T]:
        """The rule of one rank: ``"rank:N"``, else the longest device-name key, else ``"*"`` (``None``: none)."""
        by_key = dict(self.rules)
        if f"{RANK_PREFIX}{rank}" in by_key:
            return by_key[f"{RANK_PREFIX}{rank}"]
        lowered = device_name.lower()
        matches = [(key, value) for key, value in self.rules
                   if key != ANY_DEVICE and not key.startswith(RANK_PREFIX) and key.lower() in lowered]
        if matches:
            return max(matches, key=lambda kv: len(kv[0]))[1]
        return by_key.get(ANY_DEVICE)

    def for_device(self, device: RankedDevice) -> T:
        """The rule of ``device``'s rank, or a ``ValueError`` naming the rank, its device and host."""
        rule = self.lookup(device.rank, device.name)
        if rule is None:
            raise ValueError(
                f"`{self.owner}` keys {self.keys} match neither rank {device.rank} (device name {device.name!r} on "
                f"host {device.host}) nor 'rank:{device.rank}'; add a key for it or a '*' fallback."
            )
        return rule
