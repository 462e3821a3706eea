"""sync/reach.py without a network: relay options, the reachability line, the p2pd flag patch, CLI checks."""
from __future__ import annotations

from hivemind.p2p import P2P

from peer.run import main
from sync.reach import NetworkMode, reachability_line, relay_client_options, static_relays_only

RELAY = "/ip4/203.0.113.7/tcp/31337/p2p/QmT2wXyZ9mCn7vdHoJCPX1HHuRnLpXMt8fQ9pZgaQQ1YGz"


def test_relay_client_options_announce_circuit_through_each_initial_peer() -> None:
    options = relay_client_options([RELAY], ["/ip4/198.51.100.4/tcp/31338"])
    assert options["use_auto_relay"] and options["force_reachability"] == "private"
    assert options["trusted_relays"] == [RELAY]
    assert options["announce_maddrs"] == ["/ip4/198.51.100.4/tcp/31338", f"{RELAY}/p2p-circuit"]


def test_static_relays_only_adds_the_flag_and_restores_hivemind() -> None:
    original = P2P.__dict__["_make_process_args"]
    with static_relays_only():
        args = P2P._make_process_args("p2pd", relay=True)
    assert "-relayDiscovery=0" in args or "-relayDiscovery=false" in [a.lower() for a in args], args
    assert P2P.__dict__["_make_process_args"] is original
    assert not any("relayDiscovery" in a for a in P2P._make_process_args("p2pd", relay=True))


def test_reachability_line_names_the_mode_and_why() -> None:
    assert "through relays QQ1YGz (--use-auto-relay)" in reachability_line(NetworkMode(use_auto_relay=True), [],
                                                                             [RELAY])
    assert "client mode" in reachability_line(NetworkMode(client_mode=True), [])
    line = reachability_line(NetworkMode(), ["/ip4/10.1.2.3/tcp/4/p2p/Qm"])
    assert "private addresses only" in line and "--use-auto-relay" in line
    assert reachability_line(NetworkMode(), ["/ip4/1.2.3.4/tcp/4"]) == \
        "reachability: public, listening on /ip4/1.2.3.4/tcp/4"  # a string only: never dialed


def test_nat_flags_need_initial_peers(caplog) -> None:
    for flag in ("--use-auto-relay", "--client-mode"):
        caplog.clear()
        assert main(["--config", "configs/tiny.yaml", flag]) == 2
        assert f"error: {flag} needs --initial-peers" in caplog.records[-1].getMessage()
