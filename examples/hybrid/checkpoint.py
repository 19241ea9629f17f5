"""Checkpoints: one file per pipeline stage, written by the stage's DP replica 0.

Layout: ``<dir>/step-NNNNNN/stage-PP.pt`` holds the stage's parameters, its optimizer
state and what must match on resume (the block range of the stage); ``<dir>/latest``
names the newest complete checkpoint and is written by global rank 0 only after every
stage file is in place (a barrier), each write a temporary file and a rename.  A job
killed mid-save thus resumes from the previous complete checkpoint.

The DP replicas hold identical parameters and optimizer state, so a checkpoint can be
resumed with another --dp or micro-batch split (greyhound's S4 requeue); the pipeline
partition must stay the same.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from greyhound.atomic_file import atomic_file, write_atomic

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not fit this job (one-line message)."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _atomic_save(obj, path: Path) -> None:
    with atomic_file(path, mode=0o644) as f:
        torch.save(obj, f)


def stage_state(*, pp_rank: int, layers: range, module, optimizer) -> dict:
    """A stage's training state, as a stage file holds it (and as S3 sends it to a rank
    that takes the stage, hybrid/relayout.py). The tensors alias the live ones."""
    return {
        "pp_rank": pp_rank,
        "layers": [layers.start, layers.stop],
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
    }


def load_stage_state(state: dict, *, pp_rank: int, layers: range, module, optimizer, source: str,
                     hint: str = "") -> None:
    """Loads a stage's state (from ``source``: a file, a rank) into a stage built for
    ``pp_rank`` and its blocks; CheckpointError when it is another stage's."""
    if state["pp_rank"] != pp_rank or state["layers"] != [layers.start, layers.stop]:
        raise CheckpointError(f"{source}: stage {state['pp_rank']} held blocks {state['layers']}, this job gives "
                              f"stage {pp_rank} [{layers.start}, {layers.stop}){hint}")
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def save(root: str, *, step: int, pp_rank: int, dp_rank: int, rank: int, module, optimizer,
         layers: range) -> None:
    """Collective over the world: save the state after ``step`` completed steps."""
    root_path = Path(root)
    step_dir = _step_dir(root_path, step)
    if dp_rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
        state = {"step": step, **stage_state(pp_rank=pp_rank, layers=layers, module=module, optimizer=optimizer)}
        _atomic_save(state, step_dir / f"stage-{pp_rank:02d}.pt")
    dist.barrier()
    if rank == 0:
        write_atomic(root_path / LATEST, step_dir.name + "\n", mode=0o644)


def latest_step(root: str) -> int | None:
    """Completed steps of the newest complete checkpoint under ``root``; None when there
    is none yet (a requeued job that always passes --resume then starts afresh)."""
    marker = Path(root) / LATEST
    try:
        name = marker.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {marker}: {exc.strerror}") from None
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        raise CheckpointError(f"{marker}: names {name!r}, expected step-NNNNNN") from None


def load(root: str, *, step: int, pp_rank: int, module, optimizer, layers: range, device) -> None:
    """Load stage ``pp_rank``'s state of the checkpoint after ``step`` steps."""
    path = _step_dir(Path(root), step) / f"stage-{pp_rank:02d}.pt"
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing (was it saved with another --pp?)") from None
    load_stage_state(state, pp_rank=pp_rank, layers=layers, module=module, optimizer=optimizer, source=str(path),
                     hint="; resume with the same --pp and --stage-layers")
