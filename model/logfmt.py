"""One log line format for every entry point (peer.run, dht_bootstrap, peer.eval, peer.status, model.export,
model.upcycle): `Dec 06 12:40:14.293 [INFO] message`. The code location (`[module.function:line]`) is shown at
DEBUG only: a user reading an error needs its cause, not where in the code it was raised. Here, not in peer/,
because model/ never imports hivemind; peer/logs.py puts this formatter on hivemind's handler."""
from __future__ import annotations

import logging
import sys

_FORMAT, _DATE = "%(asctime)s.%(msecs)03d [%(levelname)s] %(message)s", "%b %d %H:%M:%S"


class LineFormatter(logging.Formatter):
    """The project's line format; honours hivemind's `origin_created` extra (a record logged on behalf of another
    process keeps its own time)."""

    def __init__(self) -> None:
        super().__init__(_FORMAT, datefmt=_DATE)

    def format(self, record: logging.LogRecord) -> str:
        if hasattr(record, "origin_created"):
            record.created = record.origin_created
            record.msecs = (record.created - int(record.created)) * 1000
        line = super().format(record)
        if record.levelno < logging.INFO:
            where = getattr(record, "caller", f"{record.name}.{record.funcName}:{record.lineno}")
            head = f"[{record.levelname}]"
            line = line.replace(head, f"{head} [{where}]", 1)
        return line


def setup_plain_logging(level: int = logging.INFO) -> None:
    """The root logger at `level`, printing LineFormatter lines to stderr, for entry points without hivemind;
    transformers' progress bars off (a bar is not a log line). Idempotent."""
    root = logging.getLogger()
    root.setLevel(level)
    if not any(isinstance(h.formatter, LineFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(LineFormatter())
        root.addHandler(handler)
    try:
        import transformers.utils.logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
