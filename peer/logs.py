"""One log format for the peer, the bootstrap node and the benchmarks, and no noise from normal operation.

* hivemind's handler sits on the root logger, so hivemind, transformers, datasets and this project all print
  one line each, in one format: the project's (model/logfmt.py `LineFormatter`, also used by model.export and
  model.upcycle), which shows code locations at DEBUG only. huggingface_hub and datasets also install stderr
  handlers of their own: every retry warning then came out twice (once raw, once formatted), so theirs are
  removed.
* Failures that are part of normal operation on the internet (a peer that left mid-transfer, a timeout) are logged by hivemind with a full traceback at ERROR level: 20 lines that look like
  a crash, each followed by this project's own one-line warning about the same round. They become one WARNING
  line naming the exception. Anything unexpected keeps its traceback.

The handler (with its filter) is inherited by the DHT process forked after setup_logging(), so its records are
shortened too.
"""
from __future__ import annotations

import logging

from hivemind.utils.logging import use_hivemind_log_handler

from model.logfmt import LineFormatter

# Exception classes (by name, anywhere in the exception's MRO) that hivemind raises and logs in normal operation.
EXPECTED_FAILURES = frozenset({
    "AllreduceException", "MatchmakingException", "TimeoutError", "CancelledError", "ConnectionError",
    "P2PDaemonError", "P2PHandlerError", "StopAsyncIteration", "IncompleteReadError", "BanError",
})
_OWN_HANDLERS = ("huggingface_hub", "datasets", "transformers")


class ExpectedFailures(logging.Filter):
    """Turns a hivemind record whose exception is an expected network failure into one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or not record.name.startswith("hivemind"):
            return True
        exc = record.exc_info[1]
        if exc is None or not EXPECTED_FAILURES & {cls.__name__ for cls in type(exc).__mro__}:
            return True
        message = record.getMessage()
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if str(exc) and str(exc) in message:
            detail = type(exc).__name__
        record.msg, record.args = f"{message} ({detail})", None
        record.exc_info = record.exc_text = None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def setup_logging(level: int = logging.INFO, libraries: bool = True) -> None:
    """Root logger at `level` with hivemind's handler and the ExpectedFailures filter. Idempotent.

    `libraries`: also route transformers', datasets' and huggingface_hub's records through it alone (imports
    them: they install their own handlers at import, which must have happened to be undone)."""
    use_hivemind_log_handler("in_root_logger")
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(LineFormatter())
        if not any(isinstance(f, ExpectedFailures) for f in handler.filters):
            handler.addFilter(ExpectedFailures())
    if not libraries:
        return
    import datasets.utils.logging  # noqa: F401 (installs its handler: removed below)
    import huggingface_hub.utils.logging  # noqa: F401
    import transformers.utils.logging
    transformers.utils.logging.disable_default_handler()
    for name in _OWN_HANDLERS:
        library = logging.getLogger(name)
        for handler in list(library.handlers):
            library.removeHandler(handler)
        library.propagate = True
