"""A DHT + ExpertExchange in a `tests.netlab` namespace, to measure an uplink with sync/uplink.py's probe.

    python -m tests.netlab_uplink --host 10.213.0.2 [--initial-peers '[...]'] [--probe PEER_ID,PEER_ID]

Prints ``{"re": "ready", "peer_id", "maddrs"}``; with --probe, then ``{"re": "probe", "mbit": rate or null}``
(the exchange's measure_upload to those peers). Serves probes (the sink) until stdin closes.
"""
from __future__ import annotations

import argparse
import json
import sys

from hivemind.p2p import PeerID

from sync.dht import start_dht
from sync.transfer import ExpertExchange


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--initial-peers", default="[]")
    parser.add_argument("--probe", default="")
    args = parser.parse_args()
    dht = start_dht(json.loads(args.initial_peers), [f"/ip4/{args.host}/tcp/0"], run_id="uplink", num_experts=4)
    exchange = ExpertExchange(dht, namespace="uplink")
    try:
        emit({"re": "ready", "peer_id": exchange.peer_id.to_base58(),
              "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
        if args.probe:
            rate = exchange.measure_upload([PeerID.from_base58(p) for p in args.probe.split(",")])
            emit({"re": "probe", "mbit": rate})
        sys.stdin.read()  # until the harness closes stdin (or dies)
    finally:
        exchange.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
