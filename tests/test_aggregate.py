"""The contribution round's decisions (sync/aggregate.py), without a DHT: who contributes, how long to wait, how
contributions are clipped and weighted, which single-owner change is accepted, which digest is the majority's."""
from __future__ import annotations

import math

import pytest
import torch

from sync.aggregate import (Announcement, aggregate, capped_weights, change_within, contributors, fetch_deadline,
                            majority_digest, median_clip_scales, rounds_to_skip)

pytestmark = pytest.mark.unit  # the fast tier: pure decisions, no DHT (python -m pytest -m unit)


def ann(round_id: int, size: int = 100) -> Announcement:
    return Announcement(round_id, size, "a" * 64, 10, ())


def test_contributors_are_this_rounds_in_peer_id_order():
    got = contributors({"c": ann(3), "a": ann(3), "b": ann(2), "d": None}, 3)
    assert list(got) == ["a", "c"]


def test_a_record_announces_its_previous_contribution_for_a_peer_still_at_that_round():
    """A peer a round behind another that moved on still finds that one's contribution to its round (`prev`)."""
    from sync.peer_record import PeerRecord
    from sync.records import check_record_payload
    record = PeerRecord("p", [1], round=5, contrib=[5, 100, "b" * 64, 7, [1]], prev=[4, 90, "c" * 64, 6, [1]])
    value = record.to_value()
    assert check_record_payload(value, 4)
    parsed = PeerRecord.from_value("p", value, 4)
    assert parsed.announcement(4) == Announcement(4, 90, "c" * 64, 6, (1,))
    assert parsed.announcement(5).round == 5 and parsed.announcement().round == 5 and parsed.announcement(3) is None
    assert contributors({"p": parsed.announcement(4)}, 4) == {"p": Announcement(4, 90, "c" * 64, 6, (1,))}
    for bad in ({**value, "prev": [5, 90, "c" * 64, 6, [1]]},  # not older than the newest
                {k: v for k, v in value.items() if k != "contrib"},  # a previous one without a newest
                {**value, "prev": [4, 90, "c" * 63, 6, [1]]}):
        assert PeerRecord.from_value("p", bad, 4) is None and not check_record_payload(bad, 4), bad


def test_fetch_deadline_scales_with_bytes_and_is_bounded():
    assert fetch_deadline(10_000_000, 1e6, 2.0, 60.0) == 20.0  # twice the bytes' time at the measured rate
    assert fetch_deadline(1000, 1e6, 2.0, 60.0) == 2.0  # floor
    assert fetch_deadline(10**12, 1e6, 2.0, 60.0) == 60.0  # cap
    assert fetch_deadline(1000, None, 2.0, 60.0) == 60.0  # unmeasured: the cap
    assert fetch_deadline(1000, math.nan, 2.0, 60.0) == 60.0


def test_median_clip_brings_outliers_to_the_median_norm():
    scales = median_clip_scales([1.0, 2.0, 100.0])
    assert scales[0] == 1.0 and scales[1] == 1.0
    assert abs(scales[2] * 100.0 - 2.0) < 1e-5
    assert median_clip_scales([1.0, math.inf]) == [1.0, 0.0]  # a non-finite contribution counts for nothing
    # A peer that trained nothing (zero change) does not set the clip: the other's change is kept whole.
    assert median_clip_scales([0.0, 3.0]) == [1.0, 1.0] and median_clip_scales([0.0, 0.0]) == [1.0, 1.0]
    assert median_clip_scales([0.0, 1.0, 2.0, 100.0])[3] == median_clip_scales([1.0, 2.0, 100.0])[2]


def test_weights_are_capped_both_ways():
    assert capped_weights([1e12, 0, -5, 50], cap=100) == [100, 1.0, 1.0, 50]


def test_one_huge_contribution_of_three_moves_the_mean_at_most_by_its_share_of_the_median():
    honest = [{"w": torch.full((1000,), 0.01)}, {"w": torch.full((1000,), 0.011)}]
    attacker = {"w": torch.full((1000,), -1000.0)}
    mean, scales = aggregate([honest[0], attacker, honest[1]], [10, 10, 10], cap=10, names=["w"])
    assert scales[1] == 0.0  # clipped to the median norm, then left out: it points against the mean
    assert torch.allclose(mean["w"], torch.full((1000,), 0.0105), atol=1e-6)
    # The norm clip alone bounds it to the median honest norm: the mean stays within 1/3 of that.
    clipped, scales = aggregate([honest[0], attacker, honest[1]], [10, 10, 10], cap=10, names=["w"], min_cosine=None)
    assert scales[1] < 1e-4 and float(clipped["w"].abs().max()) <= 0.011 / 3 + 1e-6


def test_aggregate_without_outliers_is_the_weighted_mean():
    a, b = {"w": torch.ones(4)}, {"w": torch.full((4,), 1.2)}
    mean, scales = aggregate([a, b], [1, 3], cap=100, names=["w"])
    # two contributions: the larger is clipped to the smaller's norm, then weighted
    assert scales == [1.0, float(torch.tensor(1 / 1.2, dtype=torch.float32))]
    assert torch.allclose(mean["w"], torch.ones(4))


def test_aggregate_is_bit_identical_whatever_the_thread_count():
    g = torch.Generator().manual_seed(0)
    contribs = [{"w": torch.randn(100_000, generator=g)} for _ in range(5)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = aggregate(contribs, [1, 2, 3, 4, 5], cap=4, names=["w"])
        torch.set_num_threads(max(2, threads))
        many, _ = aggregate(contribs, [1, 2, 3, 4, 5], cap=4, names=["w"])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one["w"], many["w"])


def test_single_owner_change_bound():
    assert change_within(0.5, 10.0, own_relative_change=0.02, ratio=4.0)  # 0.05 relative <= 4 x 0.02
    assert not change_within(5.0, 10.0, own_relative_change=0.02, ratio=4.0)
    assert not change_within(math.nan, 10.0, own_relative_change=0.02, ratio=4.0)
    assert change_within(0.03, 10.0, own_relative_change=0.0, ratio=4.0)  # floor: 1e-3 relative


def test_majority_digest_ties_pick_the_same_on_every_peer():
    assert majority_digest({"a": "x", "b": "y", "c": "x"}) == "x"
    assert majority_digest({"a": "y", "b": "x"}) == "x"
    assert majority_digest({}) is None


def test_a_peer_that_keeps_failing_is_skipped_for_longer_each_time():
    assert [rounds_to_skip(k) for k in range(8)] == [0, 1, 2, 4, 8, 16, 32, 32]


def test_a_reversed_contribution_at_the_median_norm_is_left_out():
    g = torch.Generator().manual_seed(1)
    common = torch.randn(5000, generator=g)
    honest = [{"w": common + 0.8 * torch.randn(5000, generator=g)} for _ in range(3)]
    honest_mean = sum(h["w"] for h in honest) / 3
    reverse = {"w": -honest_mean / honest_mean.norm() * float(honest[0]["w"].norm())}
    mean, scales = aggregate([*honest, reverse], [1, 1, 1, 1], cap=1, names=["w"])
    assert scales[3] == 0.0 and all(s > 0 for s in scales[:3])
    assert torch.allclose(mean["w"], sum(h["w"] * s for h, s in zip(honest, scales)) / 3, atol=1e-5)
    # Without the direction test the reversed one stays in and pulls the mean back.
    plain, _ = aggregate([*honest, reverse], [1, 1, 1, 1], cap=1, names=["w"], min_cosine=None)
    assert float(plain["w"].norm()) < 0.7 * float(mean["w"].norm())


def test_honest_contributions_of_one_round_all_stay_in():
    g = torch.Generator().manual_seed(2)
    common = torch.randn(5000, generator=g)
    honest = [{"w": common + 1.5 * torch.randn(5000, generator=g)} for _ in range(4)]
    _, scales = aggregate(honest, [1, 1, 1, 1], cap=1, names=["w"])
    assert all(s > 0 for s in scales)
