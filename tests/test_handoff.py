"""Handoff (issue 12): a peer taking over an expert gets the AdamW moments of the peer that trained it, through
the expert exchange, checked (names, shapes, finite; and that AdamW could have produced them) before use."""
from __future__ import annotations

import pytest
import torch

from peer.optim import adam_moment_bound, expert_moments, load_expert_moments
from tests.conftest import sync_cfg

BETAS = (0.9, 0.95)


def _adamw(model, steps: int = 3, seed: int = 0) -> torch.optim.AdamW:
    """A real AdamW over the model's trainable parameters after `steps` steps on random gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=BETAS, foreach=False)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt


def test_joiner_takes_over_the_moments_of_the_expert_it_takes(swarm_factory):
    a = swarm_factory([0, 1], sync_cfg())
    opt_a = _adamw(a.model)
    a.sync.exchange.moments_provider = lambda e: expert_moments(opt_a, a.model, e)
    b = swarm_factory([1], sync_cfg(), join=False)
    b.sync.join(step=0, tokens=0, take_over_moments=True)
    assert set(b.sync.handed_over) == {1}
    opt_b = torch.optim.AdamW([p for p in b.model.parameters() if p.requires_grad], betas=BETAS, foreach=False)
    assert load_expert_moments(opt_b, b.model, 1, b.sync.handed_over[1], BETAS) is None
    for mine, theirs in zip(b.model.expert_parameters(1), a.model.expert_parameters(1)):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_b.state[mine][key], opt_a.state[theirs][key])
        assert float(opt_b.state[mine]["step"]) == 3
    b.model.expert_parameters(1)[0].grad = torch.ones_like(b.model.expert_parameters(1)[0])
    opt_b.step()  # AdamW continues from them


@pytest.mark.parametrize("lie", ["shape", "names", "nan", "not_adamw"])
def test_hostile_moments_are_refused(swarm_factory, lie):
    a = swarm_factory([0, 1], sync_cfg())
    opt_a = _adamw(a.model)

    def lying(expert: int):
        moments = expert_moments(opt_a, a.model, expert)
        name = next(k for k in moments if k.endswith(".exp_avg"))
        if lie == "shape":
            moments[name] = torch.zeros(3)
        elif lie == "names":
            moments["layers.99.gate_up_proj.exp_avg"] = moments.pop(name)
        elif lie == "nan":
            moments[name][0] = float("nan")
        else:  # huge first moment over a tiny second one: a first update far beyond lr per element
            moments[name] = moments[name.replace(".exp_avg", ".exp_avg_sq")].sqrt() * 100 + 1.0
        return moments
    a.sync.exchange.moments_provider = lying
    b = swarm_factory([1], sync_cfg(), join=False)
    rejected_before = b.sync.rejects.total()
    b.sync.join(step=0, tokens=0, take_over_moments=True)
    if lie != "not_adamw":
        assert b.sync.handed_over == {} and b.sync.rejects.total() > rejected_before
        return
    opt_b = torch.optim.AdamW([p for p in b.model.parameters() if p.requires_grad], betas=BETAS, foreach=False)
    problem = load_expert_moments(opt_b, b.model, 1, b.sync.handed_over[1], BETAS)
    assert problem and "no AdamW run produces" in problem
    assert not opt_b.state  # nothing installed


def test_moment_bound_holds_for_adamw():
    """The bound the receiver checks is one AdamW never exceeds, even on gradients built to approach it."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], betas=BETAS, foreach=False)
    worst = 0.0
    for t in range(80):  # growing same-sign gradients maximize |m| / sqrt(v)
        p.grad = torch.tensor([(BETAS[0] / BETAS[1]) ** (-t / 2)])
        opt.step()
        state = opt.state[p]
        worst = max(worst, float(state["exp_avg"].abs() / state["exp_avg_sq"].sqrt()))
    assert 1.0 < worst <= adam_moment_bound(*BETAS)


@pytest.mark.timeout(240)
def test_peer_taking_over_a_cared_for_expert_continues_its_adamw_state(tmp_path, caplog):
    """Real peers: the run's first peer takes care of every expert and trains them; a joiner with --experts auto
    takes one of them over and starts from the caretaker's AdamW moments, not from zero."""
    import logging

    from peer.node import PeerNode
    from tests.test_restart import _tiny

    caplog.set_level(logging.INFO)
    common = ("sync.every=3", "sync.matchmaking_time=1", "sync.round_timeout=10", "train.checkpoint_every=0",
              "run_id=handoff")
    with PeerNode(_tiny(tmp_path / "a", "train.max_steps=4", *common), host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as a:
        a.run()  # its record stays live (heartbeat) and its exchange serves until shutdown
        assert sorted(a.trainer.model.owned_experts) == [0, 1, 2, 3] and len(a.sync.ownership.caretaking) == 3
        with PeerNode(_tiny(tmp_path / "b", "train.max_steps=4", *common), initial_peers=a.swarm.visible_maddrs(),
                      host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as b:
            (taken,) = b.trainer.model.owned_experts
            assert taken in a.sync.ownership.caretaking
            pairs = list(zip(b.trainer.model.expert_parameters(taken), a.trainer.model.expert_parameters(taken)))
            for mine, theirs in pairs:
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(b.trainer.optimizer.state[mine][key].float(),
                                       a.trainer.optimizer.state[theirs][key].float()), key
    assert any(f"optimizer state (AdamW moments) of experts [{taken}]" in r.getMessage() for r in caplog.records)


def test_layers_with_different_step_counts_keep_them(swarm_factory):
    """AdamW counts a step only where a parameter had a gradient: an expert's copy in a layer that got no token
    in some steps has a lower count. The new owner gets each tensor's own count (one shared count made its bias
    correction wrong for those layers), and an earlier build's single `step` is still taken for all."""
    a = swarm_factory([0, 1], sync_cfg())
    opt_a = _adamw(a.model, steps=3)
    first, *rest = a.model.expert_parameters(1)
    first.grad = torch.ones_like(first)
    for p in rest:
        p.grad = None  # no token for these in this step: AdamW leaves their state alone
    opt_a.step()
    counts = [float(opt_a.state[p]["step"]) for p in a.model.expert_parameters(1)]
    assert counts[0] == 4 and set(counts[1:]) == {3}
    a.sync.exchange.moments_provider = lambda e: expert_moments(opt_a, a.model, e)
    b = swarm_factory([1], sync_cfg(), join=False)
    b.sync.join(step=0, tokens=0, take_over_moments=True)
    opt_b = torch.optim.AdamW([p for p in b.model.parameters() if p.requires_grad], betas=BETAS, foreach=False)
    assert load_expert_moments(opt_b, b.model, 1, b.sync.handed_over[1], BETAS) is None
    assert [float(opt_b.state[p]["step"]) for p in b.model.expert_parameters(1)] == counts

    def single_step(expert: int):  # what an owner of an earlier build serves
        moments = expert_moments(opt_a, a.model, expert)
        steps = [k for k in moments if k.endswith(".step")]
        moments["step"] = moments[steps[0]]
        for k in steps:
            del moments[k]
        return moments
    a.sync.exchange.moments_provider = single_step
    c = swarm_factory([1], sync_cfg(), join=False)
    c.sync.join(step=0, tokens=0, take_over_moments=True)
    opt_c = torch.optim.AdamW([p for p in c.model.parameters() if p.requires_grad], betas=BETAS, foreach=False)
    assert load_expert_moments(opt_c, c.model, 1, c.sync.handed_over[1], BETAS) is None
    assert {float(opt_c.state[p]["step"]) for p in c.model.expert_parameters(1)} == {counts[0]}


def test_an_adopter_that_adopted_before_it_saw_the_tombstone_still_gets_the_moments(swarm_factory):
    """A round can adopt a leaver's experts before the background reader (which fetches a leaver's moments) saw
    its tombstone: a lone peer's rounds take a fraction of a second. The reader then fetches them for the experts
    adopted without them, and the next round hands them to the training loop."""
    import threading
    import time

    from tests.conftest import round_all

    cfg = sync_cfg(record_ttl=6.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    opt_b = _adamw(b.model)
    b.sync.exchange.moments_provider = lambda e: expert_moments(opt_b, b.model, e)
    round_all([a, b])  # each saw the other's experts owned
    watch = a.sync.progress.on_read
    a.sync.progress.on_read = lambda records: None  # a's reader does not look at leavers yet
    b.sync.leave_soon()
    leaving = threading.Thread(target=b.sync.shutdown)  # tombstone, then serves its moments for LEAVE_GRACE s
    leaving.start()
    try:
        deadline = time.monotonic() + 10
        while {2, 3} - set(a.swarm.left_by()) and time.monotonic() < deadline:
            a.swarm.peers()  # a read that sees the tombstone
            time.sleep(0.05)
        for step in range(2, 12):  # (rounds find their read incomplete while the reader's view, <= 2 s old, has b)
            report = a.sync.round(step=step, tokens=100 * step, tokens_since_last=100)
            if report.adopted:
                break
            time.sleep(0.5)
        assert report.adopted == [2, 3] and not a.sync.handed_over, report
        a.sync.progress.on_read = watch
        while set(a.sync._left_moments) != {2, 3} and time.monotonic() < deadline:
            time.sleep(0.05)
        a.sync.round(step=20, tokens=2000, tokens_since_last=100)
        assert set(a.sync.handed_over) == {2, 3}
    finally:
        leaving.join(timeout=15)


def test_a_leavers_poke_makes_an_idle_reader_fetch_the_moments_in_time(swarm_factory):
    """Between rounds the records' reader reads only every few seconds (sync.progress); a leaver serves its
    moments for LEAVE_GRACE s only. Its poke (sync.leave.likely_adopters) makes the adopter read at once."""
    import threading
    import time

    from tests.conftest import round_all

    cfg = sync_cfg(record_ttl=6.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    opt_b = _adamw(b.model)
    b.sync.exchange.moments_provider = lambda e: expert_moments(opt_b, b.model, e)
    round_all([a, b])  # each saw the other's experts owned
    a.sync.progress.hot, a.sync.progress.idle_poll = (lambda: False), 600.0  # mid-interval: no read for minutes
    time.sleep(2 * a.sync.progress.poll)
    reads = a.sync.progress.reads
    b.sync.leave_soon()
    leaving = threading.Thread(target=b.sync.shutdown)  # tombstone, poke, then serves its moments
    leaving.start()
    try:
        deadline = time.monotonic() + 10
        while set(a.sync._left_moments) != {2, 3} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(a.sync._left_moments) == {2, 3}
        assert a.sync.progress.reads - reads <= 2  # the poke's read (and one more if a poke came twice)
    finally:
        leaving.join(timeout=15)
