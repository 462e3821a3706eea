"""A bare hivemind DecentralizedAverager driven over stdin/stdout, to run inside a `tests.netlab` namespace
(`python -m bench.wan --raw-link` runs 4 of them: hivemind's all-reduce alone on the links, no training, no SPES).

    python -m bench.ar_agent --host 10.213.0.1 --numel 4500000 [--initial-peers '["/ip4/.../p2p/..."]']
        [--aggregation centered_clip]

It starts a DHT and one averager over a float32 vector of `numel` values (no compression, equal bandwidths),
prints ``{"re": "ready", "maddrs": [...]}``, then answers one JSON request per stdin line with one
``{"re": OP, ...}`` line (see tests/netlab.py `NsProcess.request`):

* ``step {at, timeout}``: all-reduce with the other agents, looking for the group from now and starting it at
  DHT time `at` at the latest (hivemind's `scheduled_time`); replies with DHT times ``grouped`` (the all-reduce
  began: hivemind's stage RUNNING_ALLREDUCE, polled every 5 ms) and ``done``, and the group size;
* ``quit``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time

logger = get_logger(__name__)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def step(averager: DecentralizedAverager, at: float, timeout: float) -> dict:
    control = averager.step(scheduled_time=at, timeout=timeout, wait=False)
    grouped = None
    while not control.done():
        if grouped is None and control.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED):
            grouped = get_dht_time()
        time.sleep(0.005)
    done = get_dht_time()
    try:
        gathered = control.result()
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": gathered is not None, "group": len(gathered or {}), "grouped": grouped or done, "done": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--initial-peers", default="[]")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--part-size", type=int, default=DEFAULT_PART_SIZE_BYTES)
    parser.add_argument("--aggregation", default="", help="reduce with sync.robust's rule (e.g. centered_clip) "
                        "instead of hivemind's weighted mean, as SPES peers do")
    args = parser.parse_args()
    if args.aggregation:
        from sync.robust import AggregationPolicy, install_robust_reducer
        install_robust_reducer(AggregationPolicy(args.aggregation))  # before the averager process forks
    dht = DHT(host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=json.loads(args.initial_peers), start=True)
    averager = None
    try:
        averager = DecentralizedAverager(
            [torch.randn(args.numel)], dht, prefix="wan_ar", start=True, target_group_size=args.group,
            min_matchmaking_time=2.0, request_timeout=2.0, part_size_bytes=args.part_size)
        emit({"re": "ready", "maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            if req["op"] == "quit":
                emit({"re": "quit"})
                break
            try:
                reply = step(averager, float(req["at"]), float(req.get("timeout", 60)))
            except Exception as e:
                logger.exception(f"request {req} failed")
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            emit({"re": req["op"], **reply})
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
