"""Byzantine benchmark (issue 9): 3 honest `peer.run` processes + 1 attacker, one arm per attack.

    python -m bench.byzantine                            # every contribution attack (c_*) + baselines (~6 min)
    python -m bench.byzantine --quick --attacks c_scale --baselines reference
    python -m bench.byzantine --attacks round,tombstone,expert,silent   # the record / expert-exchange attacks
    python -m bench.byzantine --attacks d_junk,d_records,d_ghosts --baselines reference --steps 200   # floods
    python -m bench.byzantine --closed --attacks d_records --baselines reference --steps 200   # in a closed run

Each arm starts a `dht_bootstrap` node for the arm's run on 127.0.0.1 (it validates records as a real one does),
three honest `python -m peer.run` peers (experts
0-1, 2-3, 4-5 of 8: experts 6-7 are owned by nobody, and the attackers that need to claim an expert take those,
serving the initial value every peer holds) and one `python -m bench.adversary` process. Rounds are blocking
(`sync.overlap: false`) and every peer evaluates right after each round, so the held-out loss at the last step
is that of the synchronized model; honest peer i has the same identity (so the same data order) in every arm.
Baselines, with nobody attacking: `reference` (the same 3 honest peers: every ratio is to it) and `honest4`
(4 honest peers, experts 6-7 owned too).

Per arm: honest held-out loss (mean over the honest peers that finished), its ratio to the reference, honest
peers that exited non-zero, refusals (the counters by reason that the peers' metrics.jsonl carry, where this
build writes them; else the per-round `rejected N` of their logs), rounds averaged / rounds completed, mean round
seconds, the largest round counter an honest peer reached (a forged round shows here), honest tokens per second
(first to last metrics.jsonl line) as a ratio to the reference, the peak resident memory of an honest peer's
process tree (with its DHT process and p2pd; sampled every second) and its difference to the reference's, how
many experts an honest peer trained in the second half, the most claimants without deeds a peer
(`unserved_claims`) and the bootstrap's status line counted, and what the attacker did.
Writes results.json and table.md into --out; arm logs and run dirs go to --work-dir.

Every peer of every arm, honest and attacker alike, runs the contribution protocol with `sync.compression: sparse`
(SYNC_OVERRIDE; the aggregate is always the robust one, so there is no plain-averaging arm). The default attacks
are the contribution attacks of bench/adversary.py (c_*); its record and expert-exchange attacks (round,
tombstone, expert, silent) run when named in --attacks. With `--closed` every arm is a closed run: an organizer
key made for the bench, a ticket for each honest identity, the bootstrap node and the honest peers given the key;
the attacker gets no ticket (a stranger, as Sybils of an open run would be).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from bench.adversary import ATTACKS, CONTRIB_ATTACKS
from bench.common import REPO_ROOT, config_path, format_table, logger, setup_logging, tree_rss
from bench.convergence import _deep_merge, _stop, await_address

HONEST_EXPERTS = ["0-1", "2-3", "4-5"]
FOURTH_EXPERTS = "6-7"
SCALES = {"default": {"steps": 60, "every": 10}, "quick": {"steps": 20, "every": 10}}
BASELINES = ("reference", "honest4")
# Every peer of every arm, honest and attacker: the codec named, so that the bench does not follow a changed default.
SYNC_OVERRIDE: dict[str, Any] = {"sync": {"compression": "sparse"}}
DEFAULT_ATTACKS = CONTRIB_ATTACKS
_ROUND_RE = re.compile(r"round (\d+) applied at step \d+: shared group (\d+)(.*)")
_SECONDS_RE = re.compile(r"([\d.]+)s \(([\d.]+)s blocked\)")


@dataclasses.dataclass
class Arm:
    name: str
    honest: int                  # honest peer.run processes
    attack: str | None = None    # bench.adversary attack, or None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_arms(attacks: list[str], baselines: list[str]) -> list[Arm]:
    arms = []
    for name in baselines:
        if name == "reference":
            arms.append(Arm("reference", 3))
        elif name == "honest4":
            arms.append(Arm("honest4", 4))
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    for attack in attacks:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")
        arms.append(Arm(attack, 3, attack=attack))
    for arm in arms:
        arm.overrides = _deep_merge(SYNC_OVERRIDE, arm.overrides)
    return arms


def arm_config(arm: Arm, steps: int, every: int) -> dict[str, Any]:
    """configs/tiny.yaml with 8 experts, this arm's schedule and blocking, organized rounds (no honest peer
    trains before all honest peers are in)."""
    base = yaml.safe_load(config_path("tiny").read_text())
    cfg = _deep_merge(base, {
        "run_id": f"byz-{arm.name.replace('_', '-')}",
        "model": {"num_experts": 8},
        "train": {"max_steps": steps, "log_every": every, "eval_every": every, "eval_batches": 4,
                  "checkpoint_every": 0, "warmup_steps": max(1, steps // 10)},
        "sync": {"every": every, "overlap": False, "matchmaking_time": 10.0, "round_timeout": 20.0,
                 "wait_for_peers": arm.honest,
                 "merge": {"interval": 2 * every, "alpha": 0.0, "decay_steps": steps, "topk": 2}},
    })
    return _deep_merge(cfg, arm.overrides)


def _popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    # Own session: a kill of its process group reaches its DHT children and their p2pd daemons too.
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _start_bootstrap(log_path: Path, run_id: str, env: dict[str, str],
                     flags: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """The project's bootstrap node for the arm's run (it validates the run's records, as a real one does);
    returns it and its multiaddr."""
    proc = _popen([sys.executable, "-m", "dht_bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                   "--run-id", run_id, "--num-experts", "8", "--status-every", "5", *flags], log_path, env)
    return proc, await_address(proc, log_path, r"initial peer: (\S+)", "dht_bootstrap")


class RssSampler(threading.Thread):
    """Peak resident memory of each process tree (a peer.run process with its DHT process and p2pd), sampled
    every `interval` s (bench.common.tree_rss)."""

    def __init__(self, pids: list[int], interval: float = 1.0):
        super().__init__(daemon=True)
        self.pids, self.interval = list(pids), interval
        self.peak_mib = {pid: 0.0 for pid in pids}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            for pid in self.pids:
                self.peak_mib[pid] = max(self.peak_mib[pid], tree_rss(pid) / 2**20)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes (None: killed at the deadline)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)
    return codes


def honest_identities(folder: Path, count: int = 4) -> list[Path]:
    """Fixed libp2p identities for honest peer i of every arm: a peer's data order is derived from its peer ID,
    so with fresh IDs each arm would read different data and the ratios would carry that noise too."""
    from hivemind.p2p import P2P
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"honest{i}.key" for i in range(count)]
    for path in paths:
        if not path.exists():
            P2P.generate_identity(str(path))
    return paths


def closed_run_flags(folder: Path, run_id: str, identities: list[Path]) -> tuple[list[str], list[list[str]]]:
    """`--closed`: an organizer key in `folder` and a ticket per identity for `run_id`; returns the bootstrap
    node's extra flags and each honest peer's."""
    from sync.admission import encode_signed, generate_organizer_key, peer_id_from_identity, sign_ticket
    key = folder / "organizer.key"
    public = generate_organizer_key(str(key))
    peers = []
    for i, identity in enumerate(identities):
        ticket = folder / f"honest{i}.ticket"
        ticket.write_text(encode_signed(sign_ticket(str(key), run_id, peer_id_from_identity(str(identity)), 1)))
        peers.append(["--organizer-key", public, "--ticket", str(ticket)])
    return ["--organizer-key", public], peers


def run_arm(arm: Arm, steps: int, every: int, work: Path, timeout: float, identities: list[Path],
            closed: bool = False) -> dict[str, Any]:
    arm_dir = work / arm.name
    shutil.rmtree(arm_dir, ignore_errors=True)
    arm_dir.mkdir(parents=True)
    cfg_path = arm_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(arm_config(arm, steps, every), sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    experts = HONEST_EXPERTS + [FOURTH_EXPERTS]
    run_id = arm_config(arm, steps, every)["run_id"]
    boot_flags, peer_flags = closed_run_flags(arm_dir, run_id, identities) if closed else ([], [[]] * len(identities))
    bootstrap, maddr = _start_bootstrap(arm_dir / "bootstrap.log", run_id, env, boot_flags)
    procs: list[subprocess.Popen] = []
    attacker = sampler = None
    started = time.time()
    try:
        for i in range(arm.honest):
            procs.append(_popen([sys.executable, "-m", "peer.run", "--config", str(cfg_path), "--initial-peers", maddr,
                                 "--run-dir", str(arm_dir / f"peer{i}"), "--experts", experts[i],
                                 "--identity-path", str(identities[i]),
                                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *peer_flags[i]],
                                arm_dir / f"peer{i}.log", env))
        if arm.attack:
            attacker = _popen([sys.executable, "-m", "bench.adversary", "--attack", arm.attack,
                               "--initial-peers", maddr, "--config", str(cfg_path), "--wait-peers", str(arm.honest),
                               "--stats-out", str(arm_dir / "attacker.json")], arm_dir / "attacker.log", env)
        sampler = RssSampler([proc.pid for proc in procs])
        sampler.start()
        codes = _wait_all(procs, timeout)
        wall = time.time() - started
    finally:
        if sampler is not None:
            sampler.stop()
        for proc in procs:
            _stop(proc)
        if attacker is not None:
            _stop(attacker)
        _stop(bootstrap)
    result = summarize(arm, arm_dir, codes, wall, steps)
    result["rss_peak_mib"] = max(sampler.peak_mib.values()) if sampler is not None else None
    boot = (arm_dir / "bootstrap.log").read_text(errors="replace")
    counts = re.findall(r"(\d+) claiming experts but never", boot)
    result["bootstrap_unserved"] = max((int(n) for n in counts), default=0)
    if attacker is not None:
        result["attacker_rc"] = attacker.returncode
        stats = arm_dir / "attacker.json"
        result["attacker"] = json.loads(stats.read_text()) if stats.exists() else None
    return result


def _peer_summary(run_dir: Path, log: Path, steps: int) -> dict[str, Any]:
    records = []
    if (run_dir / "metrics.jsonl").exists():
        records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    evals = [r for r in records if "eval_loss" in r]
    last = records[-1] if records else {}
    timed = [r for r in records if "time" in r and "tokens" in r]
    throughput = ((timed[-1]["tokens"] - timed[0]["tokens"]) / (timed[-1]["time"] - timed[0]["time"])
                  if len(timed) > 1 and timed[-1]["time"] > timed[0]["time"] else None)
    # Experts this peer trained in the second half of the run (a ghost owner that took them away shows here).
    trained = sorted(set().union(*(r.get("owned_experts", []) for r in records if r.get("step", 0) > steps // 2)))
    text = log.read_text(errors="replace") if log.exists() else ""
    groups, seconds, logged_rejects = [], [], 0
    for match in _ROUND_RE.finditer(text):
        groups.append(int(match.group(2)))
        rest = match.group(3)
        found = _SECONDS_RE.search(rest)
        if found:
            seconds.append(float(found.group(1)))
        rejected = re.search(r"rejected (\d+)", rest)
        logged_rejects += int(rejected.group(1)) if rejected else 0
    # Refusal counters by reason, where this build writes them into metrics.jsonl.
    counters = next((r[k] for r in reversed(records) for k in ("rejected", "rejects") if isinstance(r.get(k), dict)),
                    None)
    return {"final_eval": evals[-1]["eval_loss"] if evals and evals[-1]["step"] == steps else None,
            "last_eval": evals[-1]["eval_loss"] if evals else None, "step": last.get("step", 0),
            "round_counter": last.get("rounds", 0), "groups": groups, "round_s": seconds,
            "redownloads": text.count("re-downloaded"), "logged_rejects": logged_rejects, "rejected": counters,
            "rollbacks": last.get("rollbacks"), "alone_rounds": last.get("alone_rounds"),
            "tokens_per_s": throughput, "trained_experts": trained,
            "unserved": max((r.get("unserved_claims", 0) for r in records), default=0),
            "error": next(iter(re.findall(r"\[ERROR\][^\n]*error: ([^\n]*)", text)), None)}


def summarize(arm: Arm, arm_dir: Path, codes: list[int | None], wall: float, steps: int) -> dict[str, Any]:
    peers = [_peer_summary(arm_dir / f"peer{i}", arm_dir / f"peer{i}.log", steps) for i in range(arm.honest)]
    finals = [p["final_eval"] for p in peers if p["final_eval"] is not None]
    refusals = None
    if any(p["rejected"] is not None for p in peers):
        refusals = {}
        for p in peers:
            for reason, n in (p["rejected"] or {}).items():
                refusals[reason] = refusals.get(reason, 0) + int(n)
    seconds = [s for p in peers for s in p["round_s"]]
    return {"arm": arm.name, "attack": arm.attack, "honest": arm.honest, "rcs": codes,
            "honest_crashed": sum(1 for c in codes if c != 0),
            "eval_loss": statistics.fmean(finals) if finals else None, "finished": len(finals),
            "rounds": statistics.fmean(len(p["groups"]) for p in peers),
            "averaged_rounds": statistics.fmean(sum(1 for g in p["groups"] if g > 1) for p in peers),
            "round_s": statistics.fmean(seconds) if seconds else None,
            "round_counter": max(p["round_counter"] for p in peers),
            "redownloads": sum(p["redownloads"] for p in peers), "refusals": refusals,
            "logged_rejects": sum(p["logged_rejects"] for p in peers),
            "rollbacks": sum(p["rollbacks"] or 0 for p in peers), "wall_s": wall,
            "tokens_per_s": (statistics.fmean(p["tokens_per_s"] for p in peers if p["tokens_per_s"])
                             if any(p["tokens_per_s"] for p in peers) else None),
            "trained_experts": len(set().union(*(p["trained_experts"] for p in peers))),
            "unserved": max((p["unserved"] for p in peers), default=0), "peers": peers}


def _fmt(x: float | None, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    return "nan" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def _refusal_text(r: dict[str, Any]) -> str:
    if r["refusals"] is not None:
        nonzero = {k: v for k, v in r["refusals"].items() if v}
        return ", ".join(f"{k} {v}" for k, v in sorted(nonzero.items())) or "0"
    return f"{r['logged_rejects']} (log)"


def tables(results: list[dict[str, Any]]) -> str:
    by_arm = {r["arm"]: r for r in results}
    ref = by_arm.get("reference", {}).get("eval_loss")
    ref_s = by_arm.get("reference", {}).get("round_s")
    ref_tps = by_arm.get("reference", {}).get("tokens_per_s")
    ref_rss = by_arm.get("reference", {}).get("rss_peak_mib")
    rows = []
    for r in results:
        loss = r["eval_loss"]
        ratio = loss / ref if (loss is not None and ref and math.isfinite(loss)) else None
        s_ratio = r["round_s"] / ref_s if (r["round_s"] is not None and ref_s) else None
        counter = r["round_counter"]
        tps, rss = r.get("tokens_per_s"), r.get("rss_peak_mib")
        rows.append([r["arm"], f"{r['honest']}" + (" + 1" if r["attack"] else ""), _fmt(loss), _fmt(ratio, ".3f"),
                     f"{r['honest_crashed']}/{r['honest']}", _refusal_text(r),
                     f"{r['averaged_rounds']:.1f}/{r['rounds']:.1f}", _fmt(r["round_s"], ".1f"), _fmt(s_ratio, ".2f"),
                     f"{counter:.3g}" if counter > 10**6 else str(counter), str(r["redownloads"]),
                     _fmt(tps / ref_tps if tps and ref_tps else None, ".2f"), _fmt(rss, ".0f"),
                     _fmt(rss - ref_rss if rss is not None and ref_rss is not None else None, "+.0f"),
                     str(r.get("trained_experts", "-")), f"{r.get('unserved', 0)}/{r.get('bootstrap_unserved', 0)}",
                     f"{r['wall_s']:.0f}"])
    return format_table(["arm", "peers", "honest eval loss", "÷ reference", "crashed", "refusals",
                         "rounds averaged/done", "round s", "round s ÷ ref", "round counter", "re-downloads",
                         "tokens/s ÷ ref", "RSS peak MiB", "RSS − ref", "experts trained", "unserved peer/boot",
                         "wall s"], rows)


def build_id() -> str | None:
    """The git commit the bench runs on (+ "-dirty" with uncommitted changes outside bench/), if in a checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (commit + ("-dirty" if dirty else "")) if commit else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.byzantine", description=__doc__.split("\n\n")[0])
    p.add_argument("--attacks", help=f"comma list of attacks ({', '.join(ATTACKS)}); default: every attack of "
                                     "the contribution protocol (c_*)")
    p.add_argument("--baselines", help="comma list of no-attacker arms: reference (needed for the ratios), honest4; "
                                       "default: both")
    p.add_argument("--quick", action="store_true", help=f"fewer steps ({SCALES['quick']['steps']}): a smoke run")
    p.add_argument("--steps", type=int, help="local steps per peer")
    p.add_argument("--every", type=int, help="sync every H steps (also the evaluation interval)")
    p.add_argument("--out", default="bench/results/byzantine", help="where results.json and table.md go")
    p.add_argument("--work-dir", default="bench/out/byzantine", help="where each arm's logs and run dirs go")
    p.add_argument("--identities", help="folder of the honest peers' identity keys (default: WORK_DIR/identities)")
    p.add_argument("--closed", action="store_true", help="every arm a closed run: tickets for the honest peers only")
    p.add_argument("--arm-timeout", type=float, default=600, help="seconds before an arm's peers are killed")
    args = p.parse_args(argv)
    setup_logging()
    scale = dict(SCALES["quick" if args.quick else "default"])
    steps, every = args.steps or scale["steps"], args.every or scale["every"]
    if steps % every:
        p.error(f"--steps {steps} must be a multiple of --every {every} (the last evaluation follows a round)")
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    try:
        attacks = args.attacks if args.attacks is not None else ",".join(DEFAULT_ATTACKS)
        baselines = args.baselines if args.baselines is not None else ",".join(BASELINES)
        arms = build_arms(split(attacks), split(baselines))
    except ValueError as e:
        p.error(str(e))
    out, work = Path(args.out), Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    build = build_id()
    identities = honest_identities(Path(args.identities) if args.identities else work / "identities")
    results = []
    for arm in arms:
        logger.info(f"arm {arm.name}: {arm.honest} honest peer(s){' + attacker ' + arm.attack if arm.attack else ''}")
        results.append(run_arm(arm, steps, every, work.resolve(), args.arm_timeout, identities, args.closed))
        r = results[-1]
        logger.info(f"arm {arm.name} done in {r['wall_s']:.0f}s: loss {_fmt(r['eval_loss'])}, "
                    f"crashed {r['honest_crashed']}/{r['honest']}")
        (out / "results.json").write_text(json.dumps({"build": build, "sync": SYNC_OVERRIDE["sync"], "steps": steps,
                                                      "every": every, "closed": args.closed, "arms": results},
                                                     indent=1))
    codec = f"sync.compression: {SYNC_OVERRIDE['sync']['compression']}"
    closed = ", a closed run (the attacker without a ticket)" if args.closed else ""
    header = (f"build {build or 'unknown'}, {codec}{closed}: {steps} steps, H = {every}, configs/tiny.yaml with "
              f"8 experts, honest experts {', '.join(HONEST_EXPERTS)} (+ {FOURTH_EXPERTS} in the 4-peer arms)")
    text = tables(results)
    (out / "table.md").write_text(f"{header}\n\n{text}\n")
    sys.stdout.write(f"{header}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
