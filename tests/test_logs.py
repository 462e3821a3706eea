"""One line per expected network failure (peer/logs.py): hivemind logs a normal event such as "no averaging group
this round" at ERROR with a full traceback; through the peer's handler it is one WARNING line. Unexpected
exceptions keep their traceback."""
from __future__ import annotations

import io
import logging

from hivemind.averaging.partition import AllreduceException

from peer.logs import ExpectedFailures


def _emit(name: str, exc: BaseException) -> tuple[str, int]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(ExpectedFailures())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise exc
        except BaseException:
            logger.exception("Averaging step failed: could not find a group")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    return stream.getvalue(), len(stream.getvalue().strip().splitlines())


def test_expected_hivemind_failure_is_one_warning_line():
    text, lines = _emit("hivemind.averaging.averager", AllreduceException("Averaging step failed: could not find a group"))
    assert lines == 1 and text.startswith(f"{logging.getLevelName(logging.WARNING)} Averaging step failed: could not "
                                          f"find a group (AllreduceException)"), text
    text, lines = _emit("hivemind.p2p.servicer", TimeoutError("peer did not answer"))
    assert lines == 1 and "(TimeoutError: peer did not answer)" in text


def test_unexpected_failures_and_other_loggers_keep_their_traceback():
    text, lines = _emit("hivemind.averaging.averager", ValueError("a bug"))
    assert "Traceback" in text and text.startswith("ERROR")
    text, _ = _emit("sync.rounds", AllreduceException("ours"))  # this project's own records are left alone
    assert "Traceback" in text
