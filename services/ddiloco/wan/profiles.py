"""WAN bandwidth profiles, defined once in ``profiles.json`` beside this module.

The network-namespace topology and the Docker learner entrypoint both shape links from
this file, so an experiment means the same thing whichever way it is run.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

MBIT = 1_000_000  # tc's "mbit" is 10^6 bit/s, and so is ours


class ProfileError(ValueError):
    """A profile file that does not parse, or a name that it does not define."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    # bits/s for datacenter i is rates[i % len(rates)]; (None,) means unshaped.
    rates: tuple[int | None, ...]

    @property
    def shaped(self) -> bool:
        return any(r is not None for r in self.rates)

    def rate_for(self, datacenter: int) -> int | None:
        """Egress rate in bits/s of datacenter ``datacenter``'s link, or None for no limit."""
        if isinstance(datacenter, bool) or not isinstance(datacenter, int) or datacenter < 0:
            raise ValueError(f"datacenter index must be an int >= 0, got {datacenter!r}")
        return self.rates[datacenter % len(self.rates)]


def _rate_bits(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"profile {name!r}: rate_mbit must be null or a positive number, got {value!r}")
    return int(round(value * MBIT))


def parse_profiles(data: Any) -> dict[str, Profile]:
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict) or not data["profiles"]:
        raise ProfileError('profile file must be an object with a non-empty "profiles" object')
    out: dict[str, Profile] = {}
    for name, spec in data["profiles"].items():
        if not isinstance(spec, dict) or "rate_mbit" not in spec:
            raise ProfileError(f"profile {name!r}: expected an object with a rate_mbit key")
        raw = spec["rate_mbit"]
        if isinstance(raw, list):
            if not raw:
                raise ProfileError(f"profile {name!r}: rate_mbit list is empty")
            rates = tuple(_rate_bits(name, v) for v in raw)
        else:
            rates = (_rate_bits(name, raw),)
        out[name] = Profile(name=name, description=str(spec.get("description", "")), rates=rates)
    return out


def load_profiles(path: str | Path | None = None) -> dict[str, Profile]:
    """Profiles by name, from ``path`` or from the file shipped in this package."""
    if path is None:
        return dict(_packaged())
    with open(path, encoding="utf-8") as fh:
        return parse_profiles(json.load(fh))


@functools.cache
def _packaged() -> dict[str, Profile]:
    text = resources.files(__package__).joinpath("profiles.json").read_text(encoding="utf-8")
    return parse_profiles(json.loads(text))


def profile_names() -> list[str]:
    return list(_packaged())


def get_profile(name: str) -> Profile:
    profiles = _packaged()
    try:
        return profiles[name]
    except KeyError:
        raise ProfileError(f"unknown WAN profile {name!r}; defined: {', '.join(profiles)}") from None


def rate_for(profile: str | Profile, datacenter_index: int) -> int | None:
    """Egress rate in bits/s for one datacenter under a profile, or None for unshaped."""
    p = profile if isinstance(profile, Profile) else get_profile(profile)
    return p.rate_for(datacenter_index)


def format_rate(bits_per_s: int | None) -> str:
    if bits_per_s is None:
        return "unlimited"
    if bits_per_s % MBIT == 0:
        return f"{bits_per_s // MBIT} Mbit/s"
    return f"{bits_per_s / MBIT:g} Mbit/s"
