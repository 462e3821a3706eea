"""One live peer per run directory, and `--fresh` (docs/DESIGN.md, "Run safety").

Two peers started on one machine with the default `--run-dir` (`runs/<run_id>`) used to share it silently: the
second resumed the first one's checkpoint, overwrote it and interleaved its metrics.jsonl. A peer now holds an
exclusive `flock` on `<run dir>/.lock` for its whole life. The kernel drops the lock when the process (and every
child that inherited the descriptor) is gone, so a crash or SIGKILL never leaves a stale lock behind that a user
would have to delete by hand, unlike a PID file.

`--fresh` starts a run over without losing the old one: the directory is renamed to `<dir>.old-<UTC time>`
(never deleted), under the same lock check, so a live peer's directory is never moved from under it.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from hivemind.utils.logging import get_logger

from peer.config import ConfigError

logger = get_logger(__name__)

LOCK_NAME = ".lock"


class RunDirLock:
    """An exclusive lock on a run directory, held until `release` (or process exit)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None
        self._created = False  # acquire() made the directory (a failed start then leaves nothing behind)

    def acquire(self) -> "RunDirLock":
        """Take the lock, creating the directory if needed; ConfigError naming the directory (and the holder's
        PID, as it wrote it) when another live process holds it."""
        try:
            self._created = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create run dir {self.run_dir}: {e.strerror or e}") from None
        path = self.run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"run dir {self.run_dir} is in use by another live peer (pid {holder}): give this "
                              f"peer its own --run-dir (and --identity-path)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self, failed: bool = False) -> None:
        """Idempotent. The file stays (deleting it would race with a peer that just opened it), except after a
        failed start in a directory this lock created and nothing else wrote to: then both go."""
        if self._fd is not None and failed and self._created:
            path = self.run_dir / LOCK_NAME
            try:
                if [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
                    path.unlink()  # while still locked: a peer that opens it now gets a fresh one
                    self.run_dir.rmdir()
            except OSError:
                pass  # something appeared meanwhile: leave it all
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def move_aside(run_dir: Path) -> Path | None:
    """`--fresh`: rename an existing run dir to `<name>.old-<UTC time>` (a counter is appended if that exists
    too) and return the new path; None when there is nothing to move. Refused while a live peer holds it."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return None
    with RunDirLock(run_dir):  # raises if a live peer uses it; released before the rename is visible to others
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
        counter = 1
        while target.exists():
            target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{counter}")
            counter += 1
        os.rename(run_dir, target)
    logger.info(f"--fresh: moved the old run dir {run_dir} aside to {target} (nothing deleted)")
    return target
