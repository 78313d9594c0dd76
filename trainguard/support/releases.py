"""The support matrix: the framework releases trainguard supports, and the check at start.

The matrix is one data file, ``releases.json`` beside this module, read here (the check), by setup.py (the
extras' floors are its oldest releases: an install into a cluster inside the matrix changes no version) and
mirrored by the README's table (tests/unit/test_releases.py holds them equal). The adapters reach into their
framework's optimizers, engines and loops by name; a release outside the matrix may have moved any of them,
and a guard that half-works is worse than none -- so it is refused before the first step, naming the
supported ranges and the override:

    TRAINGUARD_ALLOW_UNTESTED=deepspeed,transformers   (package keys, comma-separated; "1" or "all": every one)

(``TRAINGUARD_ALLOW_UNTESTED_MEGATRON=1``, the older switch, still counts for megatron-core and Megatron-LM.)
The run_start record names every release checked and those let through untested. Inside the matrix, a key
of the block that cannot run on a series is refused by name (:func:`refused_keys`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from trainguard.errors import UnsupportedSetup

__all__ = ["Package", "package", "packages", "parse", "supported", "check", "describe", "floor", "cap",
           "constraints", "table", "refused_keys", "feature_refusal", "OVERRIDE"]

FILE = Path(__file__).with_name("releases.json")
OVERRIDE = "TRAINGUARD_ALLOW_UNTESTED"
_LEGACY = {"megatron-core": "TRAINGUARD_ALLOW_UNTESTED_MEGATRON", "megatron-lm": "TRAINGUARD_ALLOW_UNTESTED_MEGATRON"}
_ANY = 10 ** 6


@dataclass(frozen=True)
class Package:
    key: str            # "deepspeed", "transformers", "accelerate", "megatron-core", "megatron-lm"
    name: str           # as a person writes it
    distribution: str   # the pip distribution whose version counts (Megatron-LM's loop: megatron-core)
    ranges: tuple       # ((low, high), ...), low an exact release, high exact or "X.Y.*"
    tested: tuple       # the releases the suite and scripts/compat.sh run
    outside: dict       # series ("0.18") -> why it is not supported
    refused: dict       # series -> {block key: why it cannot run there}
    features: dict      # series -> {capability ("reshard"): why it is refused there when needed}


@lru_cache(maxsize=None)
def _matrix() -> dict:
    return json.loads(FILE.read_text(encoding="utf-8"))


def packages() -> dict[str, Package]:
    return {key: package(key) for key in _matrix()["packages"]}


@lru_cache(maxsize=None)
def package(key: str) -> Package:
    raw = _matrix()["packages"][key]
    return Package(key, raw["name"], raw.get("distribution", key), tuple(tuple(r) for r in raw["ranges"]),
                   tuple(raw["tested"]), dict(raw.get("outside", {})), dict(raw.get("refused", {})),
                   dict(raw.get("features", {})))


def parse(version: str) -> tuple[int, int, int]:
    """``"0.19.2+abc"``, ``"5.0.0rc1"``, ``"1.16.0.dev0"`` -> (major, minor, patch)."""
    release = version.split("+")[0]
    parts = []
    for piece in release.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _bound(text: str, high: bool) -> tuple[int, int, int]:
    if text.endswith(".*"):
        major, minor = parse(text[:-2])[:2]
        return (major, minor, _ANY if high else 0)
    return parse(text)


def series(version: str) -> str:
    major, minor, _ = parse(version)
    return f"{major}.{minor}"


def supported(key: str, version: str) -> bool:
    v = parse(version)
    return any(_bound(low, False) <= v <= _bound(high, True) for low, high in package(key).ranges)


def describe(key: str) -> str:
    """``"0.16.9-0.16.x, 0.17.6-0.17.x, 0.19.8-0.19.x"``."""
    def show(text):
        return text[:-2] + ".x" if text.endswith(".*") else text
    return ", ".join(f"{low}-{show(high)}" if low != high else low for low, high in package(key).ranges)


def floor(distribution: str) -> str:
    """The oldest supported release of a pip distribution (the extras' floor)."""
    lows = [p.ranges[0][0] for p in packages().values() if p.distribution == distribution]
    return min(lows, key=parse)


def allowed_untested(key: str) -> bool:
    chosen = {x.strip().lower() for x in os.environ.get(OVERRIDE, "").split(",") if x.strip()}
    legacy = _LEGACY.get(key)
    return bool(chosen & {"1", "all", key}) or (legacy is not None and os.environ.get(legacy) == "1")


def check(key: str, version: str) -> bool:
    """Raise :class:`UnsupportedSetup` naming the release, the supported ranges (and why its series is
    outside, when known) and the override, when ``version`` is outside the matrix. Returns False when it is
    outside but let through by the override (the caller records it), True when supported."""
    if supported(key, version):
        return True
    if allowed_untested(key):
        return False
    p = package(key)
    why = p.outside.get(series(version))
    raise UnsupportedSetup(
        f"trainguard supports {p.name} {describe(key)} (tested: {', '.join(p.tested)}); this is {p.distribution} "
        f"{version}{': ' + why if why else ''}. Use a supported release (the support matrix: README, "
        f"`trainguard versions`), or set {OVERRIDE}={key} to run the guard on it untested (the run_start record "
        "says so).")


def cap(distribution: str) -> str:
    """The first release past the matrix's top for a distribution: ``"0.20"`` when the top is ``0.19.*``."""
    tops = [_bound(p.ranges[-1][1], True) for p in packages().values() if p.distribution == distribution]
    major, minor, patch = max(tops)
    return f"{major}.{minor + 1}" if patch == _ANY else f"{major}.{minor}.{patch + 1}"


def constraints() -> str:
    """pip constraints holding an environment inside the matrix's newest releases (scripts/setup.sh: the suite
    runs the newest releases a fresh install resolves *within* the matrix, never one it would refuse)."""
    names = sorted({p.distribution for p in packages().values()})
    return "".join(f"{name}<{cap(name)}\n" for name in names)


def table() -> str:
    """The matrix as the README's Markdown table (tests/unit/test_releases.py holds the README to it)."""
    lines = ["| | supported | tested | outside the span, and why |", "|---|---|---|---|"]
    for key, p in packages().items():
        grouped: dict[str, list[str]] = {}
        for s, why in p.outside.items():
            grouped.setdefault(why, []).append(f"{s}.x")
        outside = "; ".join(f"{', '.join(names)}: {why}" for why, names in grouped.items()) or "-"
        lines.append(f"| {p.name} | {describe(key)} | {', '.join(p.tested)} | {outside} |")
    return "\n".join(lines) + "\n"


def feature_refusal(key: str, version: str, feature: str) -> str | None:
    """Why ``feature`` (e.g. "reshard": a resume at another data-parallel size) cannot run on this release
    (None: it can). The adapter refuses it by name when the run needs it, before touching any state."""
    return package(key).features.get(series(version), {}).get(feature)


def refused_keys(key: str, version: str) -> dict[str, str]:
    """The keys of the block that cannot run on this release's series, and why."""
    return dict(package(key).refused.get(series(version), {}))


def installed() -> dict[str, str | None]:
    """The installed version of each package of the matrix (None: not installed), for `trainguard versions`."""
    from importlib import metadata

    out = {}
    for key, p in packages().items():
        try:
            out[key] = metadata.version(p.distribution)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out
