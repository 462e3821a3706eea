"""SPES rounds on rate-limited links and behind a home NAT (issue 13): round time vs the link's transfer time.

    python -m bench.wan                          # every arm (needs root)
    python -m bench.wan --arms spes --steps 20   # one arm, 2 rounds
    python -m bench.wan --raw-link               # the links alone: libp2p streams, no SPES

Every arm builds a fresh tests/netlab.py `NetLab` (network namespaces, `tc tbf` rate limits, an nftables home NAT),
starts one `python -m dht_bootstrap` node (unlimited link; also the libp2p relay) and 4 `python -m peer.run`
peers inside the namespaces, as tests/test_netns.py does, with `--set sync.wait_for_peers=4`, H = `--every`
and `--steps` local steps. Every peer runs the contribution protocol with the config's codec (`sync.compression`,
default sparse; `--set sync.compression=none` for uncompressed fp32 contributions). Arms:

- `spes`: 4 public peers, each link 100 Mbit/s both ways; each peer owns a quarter of the experts
  (0-1, 2-3, 4-5, 6-7 of 8); `sync.overlap=false`, so a round's wall time is all on the clock.
- `diloco`: the same links, every peer owns every expert (`--experts all`); `sync.overlap=false`.
- `mixed`: 3 public 100 Mbit/s peers + 1 home peer behind the NAT at 20 Mbit/s down / 5 Mbit/s up (`--home-up-mbit`) with
  `--use-auto-relay`; SPES, `sync.overlap=false`. The home peer contributes like every other peer: the others
  fetch its blob through its 5 Mbit/s uplink (via the relay).
- `spes_overlap`: as `spes` with the default `sync.overlap=true` (rounds run behind training), for blocked share.
- `mixed_client`: as `mixed` with the home peer in `--client-mode` instead of `--use-auto-relay`.
- `slow`: as `spes_overlap`, with p3 limited to `SLOW_CORES` CPU cores by a cgroup (tests/swarmlab.py
  `CpuQuota`): a 3-4x slower machine. It is stopped when the fast peers finish; "steps" shows how far it got.

Per peer per round: payload bytes sent / received (delta of the metrics.jsonl `bytes_sent` / `bytes_received`
sums between the records where `rounds` advanced; `train.log_every=1`), the round's wall time and blocked time
(the peer's "round N applied ... X.XXs (Y.YYs blocked)" log line), the ideal transfer time
max(sent ÷ upload rate, received ÷ download rate) (= max(sent, received) ÷ link rate on a symmetric link), their
ratio, and per peer the share of the run's wall time the training loop was blocked (the final "sync blocked the
training loop X s of Y s" line). Per arm, over rounds 2+ that aggregated all 4 contributions on every peer: the
median round and ratio, and per phase of the round line's breakdown ("[publish ..., contribute ..., gather ...,
aggregate ..., apply ...]") its median seconds, its share of the round, and how much of its link the peer used
meanwhile (hub-side byte counters every 50 ms); the time outside the named phases (with blocking rounds mostly
the wait for the others' announcements) is its own row. `--set KEY=VALUE` passes extra settings to every peer (e.g.
sync.compression=none); `--tables-only` re-prints --out/results.json. Results: markdown tables on stdout and in
--out/{results.json,table.md}; progress on stderr. Run dirs and logs stay under --work-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from bench.common import REPO_ROOT, format_table, get_logger, setup_logging

logger = get_logger(__name__)

RUN_ID = "wan"
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Payload sent + received per peer per round with 4 peers (3 blobs out, 3 in), from sync.sparse.encoded_size:
# `bench`: configs/tiny.yaml raised, still cheap steps: ≈ 2.4 MB with the default sparse codec, ≈ 148 MB with
# sync.compression=none. `issue`: the 24 M-parameter shape of issue 13 (4 layers, 16 experts top-2, expert hidden
# 384): ≈ 3.7 MB sparse, ≈ 233 MB uncompressed.
SHAPES: dict[str, dict[str, int]] = {
    "bench": {"model.vocab_size": 8192, "model.d_model": 256, "model.n_layers": 2, "model.num_experts": 8,
              "model.expert_hidden": 512, "model.seq_len": 64, "train.batch_size": 2},
    "issue": {"model.vocab_size": 8192, "model.d_model": 256, "model.n_layers": 4, "model.num_experts": 16,
              "model.expert_hidden": 384, "model.seq_len": 64, "train.batch_size": 2},
}
SHAPE = dict(SHAPES["bench"])
PUBLIC_MBIT = 100.0
HOME_DOWN_MBIT, HOME_UP_MBIT = 20.0, 5.0
QUARTERS = "quarters"  # each peer owns its own quarter of the experts (see _experts_of)
# CPU cores (a cgroup quota) of the `slow` arm's p3, with its DHT and p2pd; the others share 2 cores, about
# 0.45 each (0.13 made it 6x slower; the table reports the measured ratio of steps).
SLOW_CORES = 0.25
ARMS: dict[str, dict[str, Any]] = {
    "spes": {"experts": QUARTERS, "home": False, "overlap": False},
    "diloco": {"experts": ["all"] * 4, "home": False, "overlap": False},
    "mixed": {"experts": QUARTERS, "home": "--use-auto-relay", "overlap": False},
    "mixed_client": {"experts": QUARTERS, "home": "--client-mode", "overlap": False},
    "spes_overlap": {"experts": QUARTERS, "home": False, "overlap": True},
    "slow": {"experts": QUARTERS, "home": False, "overlap": True, "slow_cores": SLOW_CORES},
}
ROUND_RE = re.compile(r"round (\d+) applied at step (\d+): shared group (\d+), experts synced (\d+), "
                      r"missing (.*?), rejected .* ([\d.]+)s \(([\d.]+)s blocked\)(?: \[([^\]]*)\])?$", re.M)
STEP_RE = re.compile(r"\] step (\d+)/\d+ \|")
BLOCKED_RE = re.compile(r"sync blocked the training loop ([\d.]+)s of ([\d.]+)s")
MB = 1e6
# hivemind's log line prefix ("Dec 03 02:30:00.123"): when a round line was written, to find its CPU samples.
STAMP_RE = re.compile(r"(\w{3} \d{2} \d{2}:\d{2}:\d{2}\.\d{3})")


class CpuSampler(threading.Thread):
    """This machine's CPU busy share (all cores, from /proc/stat) every `period` s while an arm runs: 4 peers share
    the cores, so a round whose transfers are slower than the link while the cores are saturated is CPU-bound
    here, not network-bound."""

    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.samples, self._stop_event = period, [], threading.Event()

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    def run(self) -> None:
        last = self._read()
        while not self._stop_event.wait(self.period):
            now = self._read()
            total = now[0] - last[0]
            if total > 0:
                self.samples.append((time.time(), 1.0 - (now[1] - last[1]) / total))
            last = now

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def busy(self, t0: float, t1: float) -> Optional[float]:
        """Mean busy share of the samples that fall in [t0, t1] (None when none do)."""
        inside = [b for t, b in self.samples if t0 <= t <= t1]
        return sum(inside) / len(inside) if inside else None


def _experts_of(spec: Any, num_experts: int) -> list[str]:
    """`--experts` of the 4 peers: a list as given, or each peer its own quarter of `num_experts`."""
    if spec != QUARTERS:
        return list(spec)
    q = num_experts // 4
    return [f"{i * q}-{(i + 1) * q - 1}" for i in range(4)]


def _metric_rounds(metrics_path: Path) -> dict[int, dict[str, int]]:
    """round id -> payload bytes moved during that round, from metrics.jsonl deltas: "sent" / "received" (all
    kinds) and per kind ("shared_sent", "expert_received", ...)."""
    out: dict[int, dict[str, int]] = {}
    last_round, last = 0, {}
    if not metrics_path.exists():
        return out
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "bytes_sent" not in rec:
            continue
        now = {"sent": sum(rec["bytes_sent"].values()), "received": sum(rec["bytes_received"].values())}
        for way in ("sent", "received"):
            for kind, n in rec[f"bytes_{way}"].items():
                now[f"{kind}_{way}"] = n
        if rec["rounds"] > last_round:
            out[rec["rounds"]] = {k: v - last.get(k, 0) for k, v in now.items()}
            last_round, last = rec["rounds"], now
    return out


def _timing(text: Optional[str]) -> dict[str, float]:
    """The round line's "[publish 0.03s, contribute 0.24s, ...]" breakdown as {phase: seconds}."""
    return {k: float(v) for k, v in re.findall(r"([\w-]+) ([\d.]+)s", text or "")}


def _label(r: dict[str, Any]) -> str:
    """An arm's row label: its name, a public link rate other than the default, its extra settings."""
    rate, home = r.get("public_mbit", PUBLIC_MBIT), r.get("home_up_mbit", HOME_UP_MBIT)
    return " ".join([r["arm"], *([f"@{rate:g}Mbit"] if rate != PUBLIC_MBIT else []),
                     *([f"home↑{home:g}Mbit"] if home != HOME_UP_MBIT and r.get("home") else []), *r.get("sets", [])])


# Round s - the named phases: with blocking rounds mostly the wait for the others' announcements.
OTHER = "outside the phases"


def _full_rounds(r: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """An arm's rounds 2+ (round 1 holds the joins) that all 4 peers completed with all 4 contributions."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for p in r["peers"]:
        for rd in p["rounds"]:
            by_round.setdefault(rd["round"], []).append(rd)
    return [rds for rid, rds in sorted(by_round.items())
            if rid >= 2 and len(rds) == 4 and all(rd["group"] >= 4 and rd["ratio"] is not None for rd in rds)]


def _arm_summary(r: dict[str, Any]) -> tuple[Optional[list[Any]], list[list[Any]]]:
    """Per arm, over _full_rounds: (its row: rounds, median round s and ratio of all peers, CPU busy share;
    one row per phase of the round line's breakdown, and OTHER: median s, median share of the round, median
    share of the peer's link used meanwhile)."""
    rounds = [rd for rds in _full_rounds(r) for rd in rds]
    if not rounds:
        return None, []
    med = statistics.median
    busy = [rd["cpu_busy"] for rd in rounds if rd.get("cpu_busy") is not None]
    row = [_label(r), len(rounds) // 4, f"{med(rd['seconds'] for rd in rounds):.2f}",
           f"{med(rd['ratio'] for rd in rounds):.2f}", f"{100 * med(busy):.0f}" if busy else "-"]
    phases = list(dict.fromkeys(k for rd in rounds for k in rd.get("timing", {})))
    phase_rows = []
    for phase in phases + [OTHER]:
        if phase == OTHER:
            took = [max(0.0, rd["seconds"] - sum(rd.get("timing", {}).values())) for rd in rounds]
        else:
            took = [rd["timing"].get(phase, 0.0) if "timing" in rd else 0.0 for rd in rounds]
        shares = [t / rd["seconds"] for t, rd in zip(took, rounds) if rd["seconds"] > 0]
        use = [rd["link_use"][phase] for rd in rounds if phase in rd.get("link_use", {})]
        phase_rows.append([_label(r), phase, f"{med(took):.2f}", f"{100 * med(shares):.0f}" if shares else "-",
                           f"{100 * med(use):.0f}" if use else "-"])
    return row, phase_rows


# Runs inside the hub namespace: every hub-side veth's byte counters every 50 ms. A hub-side device's rx is its
# node's upload, its tx the node's download (sysfs under `ip netns exec` shows the namespace's devices).
_LINK_SAMPLER = """
import sys, time
devs, out = sys.argv[2:], open(sys.argv[1], "w", buffering=1)
def read(dev, what):
    with open(f"/sys/class/net/{dev}/statistics/{what}_bytes") as f:
        return f.read().strip()
while True:
    out.write(f"{time.time():.3f} " + " ".join(f"{read(d, 'rx')} {read(d, 'tx')}" for d in devs) + "\\n")
    time.sleep(0.05)
"""


class LinkSampler:
    """Each peer's upload and download bytes every 50 ms, read on the hub's side of its access link, to show
    when in a round a link carried less than its rate (idle gaps between or inside transfer phases)."""

    def __init__(self, lab, names: list[str], path: Path):
        from tests.netlab import NsProcess

        self.names, self.path = names, path
        devs = [lab.nodes[n].link.hub_dev for n in names]
        self.proc = NsProcess([sys.executable, "-c", _LINK_SAMPLER, str(path), *devs], lab.hub,
                              path.with_suffix(".log"))

    def stop(self) -> None:
        self.proc.kill(grace=1.0)

    def utilization(self, name: str, t0: float, t1: float, up_bps: float, down_bps: float) -> Optional[float]:
        """Bytes moved in [t0, t1] over the busier direction ÷ what its link could move in that time."""
        i = self.names.index(name)
        rows = []
        for line in self.path.read_text().splitlines():
            f = line.split()
            if len(f) == 1 + 2 * len(self.names):
                rows.append((float(f[0]), int(f[1 + 2 * i]), int(f[2 + 2 * i])))
        inside = [r for r in rows if t0 <= r[0] <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (ta, up_a, down_a), (tb, up_b, down_b) = inside[0], inside[-1]
        return max((up_b - up_a) / up_bps, (down_b - down_a) / down_bps) / (tb - ta)


def _line_time(log: str, pos: int) -> Optional[float]:
    """Epoch seconds of the log line around `pos` (hivemind's prefix has no year: this year's)."""
    m = STAMP_RE.match(log, log.rfind("\n", 0, pos) + 1)
    if not m:
        return None
    stamp = datetime.strptime(f"{datetime.now().year} {m.group(1)}", "%Y %b %d %H:%M:%S.%f")
    return stamp.timestamp()


def _peer_result(name: str, proc, run_dir: Path, up: float, down: float,
                 cpu: Optional[CpuSampler] = None, links: Optional[LinkSampler] = None) -> dict[str, Any]:
    log = proc.log_path.read_text(errors="replace")
    by_round = _metric_rounds(run_dir / "metrics.jsonl")
    up_bps, down_bps = up * 1e6 / 8, down * 1e6 / 8  # bytes/s
    rounds = []
    for m in ROUND_RE.finditer(log):
        rid = int(m.group(1))
        moved = by_round.get(rid, {})
        sent, recv = moved.get("sent"), moved.get("received")
        seconds, blocked = float(m.group(6)), float(m.group(7))
        # = max(sent, received) / rate on a symmetric link; per direction on an asymmetric one (the home peer)
        ideal = max(sent / up_bps, recv / down_bps) if sent is not None else None
        end = _line_time(log, m.start())
        cpu_busy = cpu.busy(end - seconds, end) if cpu is not None and end is not None else None
        timing = _timing(m.group(8))
        # Link use per phase: the round line's phases follow each other and end at the line's time; the time
        # outside them (OTHER) is taken as lying before the gather (where the announcement wait is).
        use: dict[str, float] = {}
        if links is not None and end is not None and timing:
            spans = list(timing.items())
            other = seconds - sum(timing.values())
            if other > 0 and "gather" in timing:
                spans.insert(list(timing).index("gather"), (OTHER, other))
            t = end - sum(dur for _, dur in spans)
            for phase, dur in spans:
                u = links.utilization(name, t, t + dur, up_bps, down_bps) if dur >= 0.3 else None
                if u is not None:
                    use[phase] = u
                t += dur
        rounds.append({"round": rid, "step": int(m.group(2)), "group": int(m.group(3)), "cpu_busy": cpu_busy,
                       "experts_synced": int(m.group(4)), "missing": m.group(5), "sent": sent, "received": recv,
                       "seconds": seconds, "blocked_s": blocked, "ideal_s": ideal,
                       "ratio": seconds / ideal if ideal else None, "timing": timing, "link_use": use})
    steps = [int(x) for x in STEP_RE.findall(log)]
    bm = BLOCKED_RE.search(log)
    blocked, wall = (float(bm.group(1)), float(bm.group(2))) if bm else (None, None)
    return {"peer": name, "up_mbit": up, "down_mbit": down, "rc": proc.popen.poll(), "rounds": rounds,
            "steps": max(steps, default=0),
            "blocked_s": blocked, "wall_s": wall, "blocked_share": blocked / wall if bm else None}


def run_arm(arm: str, steps: int, every: int, timeout: float, work: Path,
            extra_sets: Optional[list[str]] = None, slow_cores: float = SLOW_CORES,
            public_mbit: float = PUBLIC_MBIT, home_up_mbit: float = HOME_UP_MBIT) -> dict[str, Any]:
    """One arm in a fresh NetLab; returns its per-peer results (everything is torn down afterwards)."""
    from tests.netlab import NetLab

    spec = ARMS[arm]
    t0 = time.monotonic()
    # Fresh run dirs: peers would resume the checkpoints an earlier invocation left there.
    shutil.rmtree(work / arm, ignore_errors=True)
    with NetLab(workdir=work / arm) as lab:
        boot_node = lab.add_public("boot")
        links: dict[str, tuple[float, float]] = {}
        for i in range(4):
            name = f"p{i}"
            if spec["home"] and i == 3:
                name = "home"
                lab.add_home(name, up_mbit=home_up_mbit, down_mbit=HOME_DOWN_MBIT)
                links[name] = (home_up_mbit, HOME_DOWN_MBIT)
            else:
                lab.add_public(name, up_mbit=public_mbit)
                links[name] = (public_mbit, public_mbit)
        boot = lab.python(boot_node, "-m", "dht_bootstrap", "--host-maddrs", f"/ip4/{boot_node.ip}/tcp/31337",
                          "--run-id", RUN_ID, "--num-experts", str(SHAPE["model.num_experts"]),
                          "--status-every", "30", name="boot")
        initial = boot.wait_log(r"initial peer: (\S+)", 60).group(1)
        sets = [f"{k}={v}" for k, v in SHAPE.items()] + [
            "sync.wait_for_peers=4", f"sync.overlap={'true' if spec['overlap'] else 'false'}",
            "train.eval_every=1000", "train.checkpoint_every=1000", "train.log_every=1",
            "train.warmup_steps=2", *(extra_sets or [])]
        procs = {}
        quota = None
        env = {**os.environ, **THREADS}
        for (name, _), experts in zip(links.items(), _experts_of(spec["experts"], SHAPE["model.num_experts"])):
            ip = lab.nodes[name].ip
            argv = ["-m", "peer.run", "--config", "configs/tiny.yaml", "--run-id", RUN_ID,
                    "--run-dir", str(lab.workdir / f"run-{name}"), "--host-maddrs", f"/ip4/{ip}/tcp/0",
                    "--initial-peers", initial, "--experts", experts, "--max-steps", str(steps),
                    "--sync-every", str(every)]
            for s in sets:
                argv += ["--set", s]
            if name == "home":
                argv.append(spec["home"])
            procs[name] = lab.python(name, *argv, name=f"peer-{name}", env=env)
            if spec.get("slow_cores") and name == "p3":
                from tests.swarmlab import CpuQuota
                quota = CpuQuota(f"spes-wan-slow-{lab.lab_id}", slow_cores)
                quota.add(procs[name].pid)  # before it forks its DHT: it inherits the limit
        deadline = time.monotonic() + timeout
        cpu = CpuSampler()
        cpu.start()
        link_sampler = LinkSampler(lab, list(links), lab.workdir / "links.txt")
        try:
            for name, proc in procs.items():
                if quota is not None and name == "p3":
                    # The slow peer never reaches --steps in time: stop it when the fast ones are done.
                    proc.popen.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except Exception:
                    logger.warning(f"{arm}: peer {name} still running after {timeout:.0f}s; killing it\n"
                                   f"{proc.log_tail(15)}")
        finally:
            cpu.stop()
            link_sampler.stop()
            if quota is not None:
                quota.close()
        peers = [_peer_result(name, proc, lab.workdir / f"run-{name}", *links[name], cpu=cpu, links=link_sampler)
                 for name, proc in procs.items()]
        for p, (name, proc) in zip(peers, procs.items()):
            if p["rc"] != 0:
                logger.warning(f"{arm}: peer {name} rc={p['rc']}:\n{proc.log_tail(20)}")
    if spec.get("slow_cores"):
        spec = {**spec, "slow_cores": slow_cores}
    return {"arm": arm, **spec, "steps": steps, "every": every, "sets": extra_sets or [], "public_mbit": public_mbit,
            "home_up_mbit": home_up_mbit,
            "seconds": time.monotonic() - t0, "peers": peers}


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def tables(results: list[dict[str, Any]]) -> str:
    rows, summary = [], []
    for r in results:
        label = _label(r)
        for p in r["peers"]:
            link = f"{p['down_mbit']:g}↓/{p['up_mbit']:g}↑"
            for rd in p["rounds"]:
                rows.append([label, p["peer"], link, rd["round"], rd["group"], rd["experts_synced"],
                             _fmt(rd["sent"] and rd["sent"] / MB, ".2f"),
                             _fmt(rd["received"] and rd["received"] / MB, ".2f"), f"{rd['seconds']:.2f}",
                             _fmt(rd["ideal_s"], ".2f"), _fmt(rd["ratio"], ".2f"), f"{rd['blocked_s']:.2f}"])
            # overlap: the last round is drained (fully blocked) after the last step; its share without it
            drain = (100 * (p["blocked_s"] - p["rounds"][-1]["blocked_s"]) / p["wall_s"]
                     if r["overlap"] and p["rounds"] and p["wall_s"] else None)
            ratios = [rd["ratio"] for rd in p["rounds"][1:] if rd["ratio"] is not None]  # round 1: joins, skew
            summary.append([label, p["peer"], link, p.get("steps", "-"), len(p["rounds"]),
                            sum(rd["group"] == 4 for rd in p["rounds"]),
                            _fmt(statistics.median(ratios) if ratios else None, ".2f"),
                            _fmt(p["blocked_s"], ".2f"), _fmt(p["wall_s"], ".1f"),
                            _fmt(p["blocked_share"] and 100 * p["blocked_share"], ".1f"), _fmt(drain, ".1f")])
    head = ["arm", "peer", "link Mbit/s", "round", "group", "experts synced", "sent MB", "recv MB", "round s",
            "ideal s", "ratio", "blocked s"]
    shead = ["arm", "peer", "link Mbit/s", "steps", "rounds", "rounds in group of 4", "median ratio (rounds 2+)", "blocked s",
             "wall s", "blocked %", "blocked % w/o final drain"]
    summaries = [_arm_summary(r) for r in results]
    arms = [row for row, _ in summaries if row]
    phases = [row for _, rows in summaries for row in rows]
    ahead = ["arm", "rounds (2+, all 4 contributions on every peer)", "median round s", "median ratio, all peers",
             "CPU busy during rounds %"]
    phead = ["arm", "phase", "median s", "median share of the round %", "median link use %"]
    r0 = results[0] if results else {"steps": "?", "every": "?"}
    shape = ", ".join(f"{k.split('.')[1]} {v}" for k, v in SHAPE.items())
    return (f"bench.wan: 4 peers, H = {r0['every']}, {r0['steps']} steps; shape tiny.yaml with {shape}\n\n"
            f"Per peer per round:\n\n{format_table(head, rows)}\n\nPer peer:\n\n{format_table(shead, summary)}\n"
            + (f"\nPer arm:\n\n{format_table(ahead, arms)}\n\nPer arm and phase of the round (the round line's "
               f"breakdown; link use: the busier direction of the peer's link ÷ its rate):\n\n"
               f"{format_table(phead, phases)}\n" if arms else ""))

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--steps", type=int, default=40, help="local steps per peer")
    p.add_argument("--every", type=int, default=10, help="H: local steps between rounds")
    p.add_argument("--arm-timeout", type=float, default=240.0, help="seconds before an arm's peers are killed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="extra peer.run --set for every peer of every arm (e.g. sync.compression=none)")
    p.add_argument("--slow-cores", type=float, default=SLOW_CORES,
                   help="CPU cores (cgroup quota) of the `slow` arm's p3")
    p.add_argument("--public-mbit", type=float, default=PUBLIC_MBIT,
                   help="public peers' link rate (symmetric): a slower link shows how much of a round's overhead "
                        "over link time is the link and how much the CPUs (4 peers share this machine's cores)")
    p.add_argument("--home-up-mbit", type=float, default=HOME_UP_MBIT,
                   help="the home peer's uplink in the mixed arms (its downlink stays 20)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                   help="model shape: bench (≈ 2.4 MB per peer per round with the sparse codec) or issue "
                        "(issue 13's 24 M-param shape, ≈ 3.7 MB)")
    p.add_argument("--raw-link", action="store_true",
                   help="only measure libp2p streams through the same links (no SPES)")
    p.add_argument("--tables-only", action="store_true", help="re-print the tables of --out/results.json")
    p.add_argument("--out", default="bench/results/wan", help="where results.json and table.md go")
    p.add_argument("--work-dir", default="bench/out/wan", help="arm logs and run dirs")
    args = p.parse_args(argv)
    setup_logging()
    SHAPE.clear()
    SHAPE.update(SHAPES[args.shape])
    out, work = Path(args.out), Path(args.work_dir).resolve()
    if args.tables_only:
        text = tables(json.loads((out / "results.json").read_text())["arms"])
        (out / "table.md").write_text(text)
        print(text)
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    from tests.netlab import netlab_unavailable

    reason = netlab_unavailable()
    if reason:
        logger.error(f"bench.wan needs the network lab: {reason}")
        return 2
    if args.raw_link:
        out.mkdir(parents=True, exist_ok=True)
        from bench.wan_raw import raw_link

        text = raw_link(args.public_mbit)
        (out / "raw-link.md").write_text(text)
        print(text)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}")
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for arm in arms:
        logger.info(f"arm {arm}: starting")
        results.append(run_arm(arm, args.steps, args.every, args.arm_timeout, work, args.sets, args.slow_cores,
                               args.public_mbit, args.home_up_mbit))
        logger.info(f"arm {arm}: done in {results[-1]['seconds']:.0f}s")
        (out / "results.json").write_text(json.dumps({"shape": SHAPE, "arms": results}, indent=1))
    text = tables(results)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
