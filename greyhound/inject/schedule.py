"""A schedule file: injections with start offsets and durations, run concurrently.

YAML, either a list of entries or a mapping with an ``injections`` list::

    injections:
      - kind: compute          # take CPU from one rank
        job: 42
        rank: 3
        severity: 0.5          # fraction of the CPU taken (default 0.5)
        start: 30              # seconds after the schedule starts
        duration: 60           # seconds
      - kind: link             # narrow one node's link
        node: n2
        rate: 200mbit
        start: 120
        duration: 60

Entry keys: ``kind``, ``start`` (default 0), ``duration`` (required), and the fields
of :class:`~greyhound.inject.spec.ComputeSpec` (pid | job+rank [+step], severity, cpus)
or :class:`~greyhound.inject.spec.LinkSpec` (node | dev [+netns], rate, burst, latency).
Unknown keys, bad values and two entries on the same target at overlapping times are
errors naming the entry.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import yaml

from greyhound.errors import InputError
from greyhound.inject.spec import ComputeSpec, LinkSpec, Spec

MAX_SECONDS = 7 * 24 * 3600.0

_SPECS = {"compute": ComputeSpec, "link": LinkSpec}
_TIMING = ("start", "duration")
_STRINGS = {"job", "step", "rate", "burst", "latency", "node", "dev", "netns"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """One injection of a schedule."""

    spec: Spec
    start_s: float = 0.0
    """Seconds after the schedule starts."""
    duration_s: float
    """Seconds the injection stays applied."""

    def __post_init__(self) -> None:
        for name, value, low_ok in (("start", self.start_s, True), ("duration", self.duration_s, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} {value!r} is not a number of seconds")
            if value < 0 or (value == 0 and not low_ok) or value > MAX_SECONDS:
                allowed = "[0" if low_ok else "(0"
                raise ValueError(f"{name} {value!r} is out of range; allowed {allowed}, {MAX_SECONDS:.0f}] seconds")

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def parse_entry(entry: object) -> Planned:
    """One schedule entry (a mapping) to a Planned; ValueError with the reason."""
    if not isinstance(entry, dict):
        raise ValueError(f"an entry must be a mapping, not {type(entry).__name__}")
    kind = entry.get("kind")
    if kind not in _SPECS:
        raise ValueError(f"kind {kind!r} is unknown; allowed: {', '.join(_SPECS)}")
    cls = _SPECS[kind]
    allowed = _field_names(cls) | set(_TIMING) | {"kind"}
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown} for a {kind} entry; allowed: {sorted(allowed)}")
    if "duration" not in entry:
        raise ValueError("duration is missing (seconds the injection lasts)")
    fields = {}
    for key, value in entry.items():
        if key in _TIMING or key == "kind":
            continue
        if key in _STRINGS and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # YAML reads `job: 42` as a number
        elif key in ("pid", "rank") and not (isinstance(value, int) and not isinstance(value, bool)):
            raise ValueError(f"{key} {value!r} is not an integer")
        elif key in ("severity", "cpus") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key} {value!r} is not a number")
        elif key in _STRINGS and not isinstance(value, str):
            raise ValueError(f"{key} {value!r} is not a string")
        fields[key] = value
    try:
        spec = cls(**fields)
    except TypeError as exc:  # a required field is missing
        raise ValueError(str(exc).split(".__init__() ")[-1]) from exc
    return Planned(spec=spec, start_s=entry.get("start", 0.0), duration_s=entry["duration"])


def check_overlaps(plans: list[Planned], *, names: list[str] | None = None) -> None:
    """ValueError if two plans act on the same target at overlapping times."""
    names = names or [f"entry {i + 1}" for i in range(len(plans))]
    for i, a in enumerate(plans):
        for j in range(i + 1, len(plans)):
            b = plans[j]
            shared = a.spec.target_keys & b.spec.target_keys
            if shared and a.start_s < b.end_s and b.start_s < a.end_s:
                raise ValueError(
                    f"{names[i]} and {names[j]} act on the same target ({a.spec.label}) at "
                    f"overlapping times [{a.start_s:g}, {a.end_s:g}) and [{b.start_s:g}, {b.end_s:g}) s"
                )


def parse_schedule(text: str, *, source: str = "schedule") -> list[Planned]:
    """Schedule YAML text to plans; InputError naming the source and entry."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise InputError(f"{source}{where}: {problem}") from exc
    if isinstance(doc, dict):
        unknown = sorted(str(k) for k in doc if k != "injections")
        if unknown:
            raise InputError(f"{source}: unknown top-level keys {unknown}; allowed: injections")
        doc = doc.get("injections")
    if not isinstance(doc, list) or not doc:
        raise InputError(f"{source}: expected a non-empty list of injections "
                         "(or a mapping with an `injections` list)")
    plans = []
    for num, entry in enumerate(doc, 1):
        try:
            plans.append(parse_entry(entry))
        except ValueError as exc:
            raise InputError(f"{source}: entry {num}: {exc}") from exc
    try:
        check_overlaps(plans)
    except ValueError as exc:
        raise InputError(f"{source}: {exc}") from exc
    return plans


def load_schedule(path: str | Path) -> list[Planned]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the schedule: {exc.strerror}") from exc
    return parse_schedule(text, source=str(path))
