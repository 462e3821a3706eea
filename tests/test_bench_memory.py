"""bench.memory's `--peer-run --repeat` report: per-arm medians and ranges, and each quarter run's ratio against the
all-owned run of the same repeat (the all-owned peak varies by ~1 GiB from run to run)."""
from __future__ import annotations

import pytest

from bench.memory import parse_args, peer_run_table

GIB = 2**30


def _run(arm: str, owned: int, gib: float) -> dict:
    return {"arm": arm, "owned": owned, "num_experts": 16, "peak_rss": gib * GIB, "wall_s": 30.0}


@pytest.mark.unit
def test_repeats_report_medians_ranges_and_ratios_per_repeat():
    runs = [_run("all_owned", 16, 18.0), _run("owned_quarter", 4, 7.2),
            _run("all_owned", 16, 20.0), _run("owned_quarter", 4, 7.0),
            _run("all_owned", 16, 19.0), _run("owned_quarter", 4, 9.5)]
    quarter = next(line for line in peer_run_table(runs).splitlines() if line.startswith("| owned_quarter"))
    cells = [c.strip() for c in quarter.strip("|").split("|")]
    assert cells[1:6] == ["4/16", "7.20", "7.00-9.50", "0.400", "0.400, 0.350, 0.500"], cells


@pytest.mark.unit
def test_repeat_below_one_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--peer-run", "--repeat", "0"])
