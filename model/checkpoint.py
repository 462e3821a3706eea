"""Checkpoint files: one safetensors file per checkpoint, written atomically, found by step number.

A checkpoint is `checkpoints/step_XXXXXXXX.safetensors` holding flat named tensors (model weights under
`model.`, optimizer state under `optim.`) and a small JSON metadata dict. It is written to a temp file and
renamed, so a file with the final name is always complete; a crash leaves only a temp file that is ignored.
Nothing is ever unpickled: safetensors stores raw tensors and a JSON header.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

FORMAT = "spes-checkpoint-v1"
_NAME_RE = re.compile(r"^step_(\d{8,})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the cause."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.safetensors"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME_RE.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def load_newest_complete(directory: str | Path, check: Callable[[dict[str, Any]], None] | None = None,
                         ) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that reads completely (and whose metadata passes `check`, which raises
    CheckpointError or KeyError/ValueError/TypeError on a bad one), as (path, tensors, metadata); None if there is
    no checkpoint at all.

    A damaged newer file (a disk that filled up, a copy cut short, bit rot: the atomic rename rules out a crash
    mid-write) costs one warning naming it, and is renamed to `<name>.corrupt` (kept for inspection, never
    deleted) so the run's next checkpoint of that step does not overwrite it and it no longer counts as the
    newest. If no checkpoint reads, the newest one's error is raised and nothing is renamed: the user decides."""
    found = list_checkpoints(directory)
    bad: list[tuple[Path, CheckpointError]] = []
    for _, path in reversed(found):
        try:
            tensors, metadata = load_checkpoint(path)
            if check is not None:
                check(metadata)
        except CheckpointError as e:
            bad.append((path, e))
            continue
        except (KeyError, ValueError, TypeError) as e:
            bad.append((path, CheckpointError(f"corrupt checkpoint {path}: bad trainer state ({e})")))
            continue
        for damaged, error in bad:
            aside = damaged.with_name(damaged.name + ".corrupt")
            os.replace(damaged, aside)
            logger.warning(f"{error}; resuming from the previous complete checkpoint {path.name} instead "
                           f"(the damaged file is kept as {aside.name})")
        return path, tensors, metadata
    if bad:
        raise bad[0][1]
    return None


def save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write tensors + JSON metadata to `path` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    meta = {"format": FORMAT, "metadata": json.dumps(metadata)}
    try:
        save_file(flat, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_safetensors(path: str | Path, fmt: str = FORMAT, kind: str = "checkpoint"
                     ) -> tuple[dict[str, torch.Tensor], Any]:
    """All tensors of a safetensors file of format `fmt` and its JSON metadata; any damage (truncation, bad header,
    wrong format) raises CheckpointError naming the `kind` of file and its path."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != fmt:
                raise CheckpointError(f"corrupt {kind} {path}: not a {fmt} file")
            metadata = json.loads(header["metadata"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt {kind} {path}: {reason}") from None
    return tensors, metadata


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a checkpoint fully; any damage (truncation, bad header, wrong format) raises CheckpointError."""
    tensors, metadata = read_safetensors(path)
    if not isinstance(metadata, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: metadata is not a JSON object")
    return tensors, metadata


def prune_checkpoints(directory: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep <= 0 keeps everything)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(directory)[:-keep]:
        path.unlink(missing_ok=True)


def model_state_for_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under `model.`, with tied (storage-sharing) tensors stored once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue  # tied weight (e.g. lm_head = embeddings); restored by the tie itself
        seen.add(ptr)
        out[f"model.{name}"] = tensor
    return out


def load_model_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy `model.`-prefixed tensors into `model` (cast to each target's dtype); shape mismatches raise."""
    state = model.state_dict()
    model_tensors = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = [k for k in state if k not in model_tensors]
    tied = {k for k in missing if any(state[k].untyped_storage().data_ptr() == state[o].untyped_storage().data_ptr()
                                      for o in model_tensors if o in state)}
    missing = [k for k in missing if k not in tied]
    if missing:
        raise CheckpointError(f"checkpoint {source} does not match the model: missing {missing[0]}"
                              f" (and {len(missing) - 1} more)" if len(missing) > 1 else
                              f"checkpoint {source} does not match the model: missing {missing[0]}")
    with torch.no_grad():
        for name, src in model_tensors.items():
            if name not in state:
                raise CheckpointError(f"checkpoint {source} does not match the model: unexpected {name}")
            dst = state[name]
            if dst.shape != src.shape:
                raise CheckpointError(f"checkpoint {source} does not match the model: {name} has shape "
                                      f"{tuple(src.shape)}, model expects {tuple(dst.shape)}")
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
