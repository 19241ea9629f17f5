"""Where active injections are recorded, so that a killed injector can be cleaned up.

Layout under the state directory (default /run/greyhound-inject, tmpfs: nothing
survives a reboot, and neither do cgroups or qdiscs):

    active/<id>.json   one file per injection from before its first change to the system
                       until it is undone; written atomically (rename)
    truth.jsonl        the default ground-truth log (see :mod:`greyhound.inject.truth`)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from greyhound.atomic_file import write_atomic
from greyhound.errors import InputError

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/run/greyhound-inject")
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
DEFAULT_CGROUP_PARENT = "greyhound"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InjectEnv:
    """Where injections keep their state and their cgroups on this machine."""

    state_dir: Path = DEFAULT_STATE_DIR
    """Active-injection records and the default truth log."""
    cgroup_root: Path = DEFAULT_CGROUP_ROOT
    """Mount point of the cgroup v1 hierarchy with the cpu controller."""
    cgroup_parent: str = DEFAULT_CGROUP_PARENT
    """Directory under ``cgroup_root`` holding one cgroup per compute injection."""

    def __post_init__(self) -> None:
        if not self.cgroup_parent or "/" in self.cgroup_parent or self.cgroup_parent in (".", ".."):
            raise ValueError(f"cgroup parent {self.cgroup_parent!r} must be one directory name")

    @property
    def active_dir(self) -> Path:
        return self.state_dir / "active"

    @property
    def default_truth(self) -> Path:
        return self.state_dir / "truth.jsonl"

    @property
    def cgroup_base(self) -> Path:
        return self.cgroup_root / self.cgroup_parent


def write_active(env: InjectEnv, record: dict) -> None:
    """Record (or update) an active injection; record['id'] names the file."""
    try:
        env.active_dir.mkdir(parents=True, exist_ok=True)
        path = env.active_dir / f"{record['id']}.json"
        write_atomic(path, json.dumps(record, sort_keys=True))
    except OSError as exc:
        raise InputError(f"cannot record the injection under {env.active_dir}: {exc.strerror}") from exc


def remove_active(env: InjectEnv, injection_id: str) -> None:
    try:
        (env.active_dir / f"{injection_id}.json").unlink()
    except FileNotFoundError:
        pass


def read_active(env: InjectEnv) -> list[dict]:
    """Every recorded active injection (unreadable records are logged and skipped)."""
    out: list[dict] = []
    if not env.active_dir.is_dir():
        return out
    for path in sorted(env.active_dir.glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable state record %s: %s", path, exc)
    return out
