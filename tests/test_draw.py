"""Which peers contribute to a round (sync/draw.py), without a DHT: tickets, the thresholds of a view, the slack
between views of different sizes, N counted by deeds, and the grace a record gets to deliver."""
from __future__ import annotations

import statistics

import pytest

from sync.config import SyncConfig
from sync.draw import Draw, count_chances, counted_peers, ticket
from sync.peer_record import OWNER_GRACE, PeerRecord

pytestmark = pytest.mark.unit


def test_a_ticket_is_the_same_for_everyone_and_new_every_round():
    assert ticket("run", 7, "peerA") == ticket("run", 7, "peerA")
    assert len({ticket("run", r, "peerA") for r in range(50)}) == 50
    assert ticket("run", 7, "peerA") != ticket("other-run", 7, "peerA")
    values = [ticket("run", r, f"peer{p}") for r in range(100) for p in range(40)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert 0.23 < sum(v < 0.25 for v in values) / len(values) < 0.27  # uniform: a quarter below 1/4


def test_every_peer_contributes_without_a_draw_or_in_a_run_no_larger_than_it():
    for draw in (Draw(0, 1000), Draw(16, 16), Draw(16, 3)):
        assert draw.drawn == draw.surely == draw.accepted == 1.0


def test_the_thresholds_of_a_view():
    draw = Draw(4, 16)
    assert (draw.surely, draw.drawn, draw.accepted) == (0.125, 0.25, 0.5)
    assert Draw(4, 6).accepted == 1.0 and Draw(4, 6).drawn == pytest.approx(4 / 6)
    assert Draw(4, 6).surely == pytest.approx(1 / 3)


def test_views_up_to_twice_apart_agree_on_who_is_drawn():
    """A peer drawn in its own view is accepted by a receiver seeing up to twice as many peers; one the receiver
    deems surely drawn is drawn in any own view up to twice the receiver's (so waiting for it is never in vain)."""
    for contributors in (1, 4, 20):
        for own in range(1, 300):
            for view in range(max(1, (own + 1) // 2), 2 * own + 1):
                mine, theirs = Draw(contributors, own), Draw(contributors, view)
                assert mine.drawn <= theirs.accepted  # every ticket below the one is below the other
                if view > contributors:  # in a view of at most C peers every peer had to deliver
                    assert theirs.surely <= mine.drawn


def test_about_c_peers_are_drawn_per_round_whatever_the_run_size():
    for peers in (32, 256, 1000):
        draw = Draw(8, peers)
        counts = [sum(ticket("run", r, f"p{i}") < draw.drawn for i in range(peers)) for r in range(200)]
        assert 7.0 < statistics.fmean(counts) < 9.0
        assert max(counts) < 24  # bounded: what a peer fetches in a round does not grow with the run


def test_n_counts_owners_by_deeds_not_claims():
    """A thousand identities that never deliver would shrink every honest peer's chance to contribute: past their
    grace they do not count in N."""
    others = {f"g{i}": PeerRecord(f"g{i}", [0]) for i in range(1000)}
    others.update({p: PeerRecord(p, [1]) for p in ("honest", "joiner")})
    chances = {f"g{i}": OWNER_GRACE + 1 for i in range(1000)} | {"joiner": 1, "honest": 40}
    assert counted_peers(others, delivered={"honest"}, chances=chances) == 3
    assert counted_peers(others, delivered={"honest"}, chances={}) == 1003  # all new: all within their grace


def test_the_grace_counts_only_rounds_a_record_was_surely_drawn_in():
    records = {p: PeerRecord(p, [0]) for p in ("a", "b")}
    first_seen: dict[str, int] = {}
    chances = count_chances({}, first_seen, records, 5, {"a": True, "b": True})
    assert chances == {"a": 0, "b": 0} and first_seen == {"a": 5, "b": 5}  # the round first seen is not one
    chances = count_chances(chances, first_seen, records, 6, {"a": True, "b": False})
    chances = count_chances(chances, first_seen, records, 7, {"a": True, "b": False})
    assert chances == {"a": 2, "b": 0}
    chances = count_chances(chances, first_seen, {"a": records["a"]}, 8, {"a": True})
    assert chances == {"a": 3}  # b's record expired: forgotten


def test_a_negative_contributor_count_is_refused():
    with pytest.raises(ValueError, match="sync.contributors"):
        SyncConfig(contributors=-1).validate()
