"""Ctrl-C and SIGTERM for a training peer: finish the current step, checkpoint, exit (a second one aborts)."""
from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import time

from hivemind.utils.logging import get_logger

if TYPE_CHECKING:
    from peer.train import Trainer

logger = get_logger(__name__)


class StopOnSignal:
    """Context manager: the first SIGINT/SIGTERM asks the trainer to stop after the current step;
    a second one interrupts immediately — unless it comes within `same_request_s` of the first: under torchrun a
    terminal's Ctrl-C reaches each worker twice at once (from the terminal, and forwarded by torchrun's agent),
    which is one request to stop, not an impatient second one.

    It may be entered before the trainer exists (`attach` it later): a signal during start-up is then held and
    the trainer stops before its first step, so start-up still ends in a clean shutdown.
    """

    same_request_s = 2.0

    def __init__(self, trainer: "Trainer | None" = None):
        self.trainer = trainer
        self.requested = False
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def attach(self, trainer: "Trainer") -> None:
        """Direct signals to `trainer`; one already received stops it at once."""
        self.trainer = trainer
        if self.requested:
            trainer.request_stop()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # A process forked while this handler was installed (hivemind's DHT process): it must die on
            # SIGTERM as usual, or hivemind's terminate() of a stuck child would not end it.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.requested:
            if time.monotonic() - self._first_at < self.same_request_s:
                return
            raise KeyboardInterrupt
        self.requested, self._first_at = True, time.monotonic()
        prefix = f"[{self.trainer.log_prefix}] " if self.trainer is not None else ""
        logger.info(f"{prefix}{signal.Signals(signum).name} received: finishing the current step, then checkpoint "
                    f"and exit (again to abort)")
        if self.trainer is not None:
            self.trainer.request_stop()

    def __enter__(self) -> "StopOnSignal":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
