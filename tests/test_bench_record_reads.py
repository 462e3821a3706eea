"""bench.record_reads' validation columns: a flood's signed records pass an open run's validator once verified and
are all refused by a closed run's (no ticket), which `validation_ms` asserts while timing them."""
from __future__ import annotations

import pytest

from bench.record_reads import validation_ms


@pytest.mark.unit
def test_validation_columns_time_an_open_run_accepting_and_a_closed_run_refusing_the_flood():
    first, again, refused = validation_ms(8)
    assert first > 0 and again > 0 and refused > 0
