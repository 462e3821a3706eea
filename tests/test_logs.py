"""One line per expected network failure (peer/logs.py): hivemind logs a normal event such as "no averaging group
this round" at ERROR with a full traceback; through the peer's handler it is one WARNING line. Unexpected
exceptions keep their traceback."""
from __future__ import annotations

import io
import logging

import pytest

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


def test_every_entry_point_prints_errors_in_one_format_without_code_locations(tmp_path):
    """peer.run and model.export (model/ without hivemind) print the same line format; a user's error names its
    cause, not the function and line that raised it (those show at DEBUG only)."""
    import re
    import subprocess
    import sys

    from tests.conftest import REPO, peer_cmd
    from tests.test_cli import _one_error_line

    line_format = r"[A-Z][a-z]{2} \d\d \d\d:\d\d:\d\d\.\d{3} \[ERROR\] error: \S"
    export = subprocess.run([sys.executable, "-m", "model.export", str(tmp_path / "missing"), str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    run = subprocess.run(peer_cmd("--config", "configs/tiny.yaml", "--set", "model.d_model=-1",
                                  "--run-dir", str(tmp_path / "run")), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    for proc in (export, run):
        assert proc.returncode == 2 and re.fullmatch(line_format + ".*", _one_error_line(proc)), proc.stderr


@pytest.mark.unit
def test_the_code_location_shows_at_debug_only():
    from model.logfmt import LineFormatter

    def line(level: int) -> str:
        record = logging.LogRecord("sync.x", level, "x.py", 7, "hello", None, None, func="f")
        return LineFormatter().format(record)
    assert line(logging.ERROR).endswith("[ERROR] hello") and line(logging.INFO).endswith("[INFO] hello")
    assert line(logging.DEBUG).endswith("[DEBUG] [sync.x.f:7] hello")
