"""Soak: a swarm that runs for a long time while one peer is killed with SIGKILL and restarted, again and again.

    python -m bench.soak                                  # 4 peers, 30 minutes, a kill + restart every 5 minutes
    python -m bench.soak --minutes 10 --kill-every 2.5    # shorter
    python -m bench.soak --out bench/results/soak/run1    # also writes table.md and the logs there

A `python -m dht_bootstrap` node (with `--metrics-port`) and N `python -m peer.run` processes on 127.0.0.1, each
with its own run dir and identity (tiny config, `--experts auto`, checkpoints every 20 steps). Every
`--kill-every` minutes one peer other than peer 0 (round-robin) gets SIGKILL, as the kernel's OOM killer would
send it, and is started again at once with the same command: it resumes from its newest checkpoint with the same
peer ID. Peer 0 is never killed: it is the survivor whose memory is followed.

Measured, from the processes themselves:
- RSS of each peer's whole process tree (peer, DHT, p2pd), sampled every 15 s; growth of the
  survivor = last sample / the first sample after warm-up (the first kill) - 1;
- processes left behind: descendants of a killed peer still alive 10 s after its SIGKILL;
- coverage: the bootstrap node's `spes_swarm_uncovered_experts` gauge, every second for 120 s after each restart
  (the most experts it showed uncovered, and until when), and the seconds until the restarted peer applied a
  round in a group again; the round period (median seconds between a peer's rounds) to compare with;
- NaN: any non-finite loss in any peer's metrics.jsonl; every peer's exit code after the final SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import descendants, format_table, get_logger, setup_logging, tree_rss

logger = get_logger(__name__)

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(p)
    return out


def uncovered(port: int) -> int | None:
    """The bootstrap node's spes_swarm_uncovered_experts, None if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = re.search(r"^spes_swarm_uncovered_experts (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else None


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.workdir = args, workdir
        self.metrics_port = _free_port()
        self.boot: subprocess.Popen | None = None
        self.peers: list[subprocess.Popen | None] = [None] * args.peers
        self.logs: list = []

    def _spawn(self, cmd: list[str], log: Path) -> subprocess.Popen:
        handle = open(log, "a")
        self.logs.append(handle)
        return subprocess.Popen(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, text=True)

    def start_bootstrap(self) -> str:
        log = self.workdir / "bootstrap.log"
        self.boot = self._spawn([sys.executable, "-m", "dht_bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                 "--run-id", "soak", "--num-experts", "4", "--metrics-port", str(self.metrics_port),
                                 "--status-every", "30"], log)
        deadline = time.time() + 120
        while time.time() < deadline:
            match = re.search(r"initial peer: (/ip4/127\.0\.0\.1/\S+)", log.read_text())
            if match:
                return match.group(1)
            time.sleep(0.5)
        raise RuntimeError("the bootstrap node printed no initial peer")

    def peer_cmd(self, i: int, initial: str) -> list[str]:
        return [sys.executable, "-m", "peer.run", "--config", "configs/tiny.yaml", "--initial-peers", initial,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "soak", "--run-dir", str(self.workdir / f"peer{i}"),
                "--identity-path", str(self.workdir / f"peer{i}.key"), "--max-steps", "100000000",
                "--sync-every", str(self.args.every), "--set", "train.checkpoint_every=20",
                "--set", "train.eval_every=0", "--set", "train.log_every=10", "--set", "sync.matchmaking_time=2",
                "--set", "sync.round_timeout=20", "--set", "sync.record_ttl=15"]

    def start_peer(self, i: int, initial: str) -> None:
        self.peers[i] = self._spawn(self.peer_cmd(i, initial), self.workdir / f"peer{i}.log")

    def round_period(self, i: int) -> float | None:
        times = [time.mktime(time.strptime(m.group(1), "%b %d %H:%M:%S")) for m in re.finditer(
            r"^(\w{3} \d\d \d\d:\d\d:\d\d)\.\d+ \[INFO\].* round \d+ applied", (self.workdir / f"peer{i}.log")
            .read_text(errors="replace"), re.M)]
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
        return statistics.median(gaps) if gaps else None

    def run(self) -> dict:
        args = self.args
        initial = self.start_bootstrap()
        for i in range(args.peers):
            self.start_peer(i, initial)
        start = time.monotonic()
        end = start + 60 * args.minutes
        next_kill = start + 60 * args.kill_every
        rss: dict[int, list[tuple[float, int]]] = {i: [] for i in range(args.peers)}
        restarts: list[dict] = []
        victim, next_sample, warm_at = 1, start, None
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                for i, proc in enumerate(self.peers):
                    if proc is not None and proc.poll() is None:
                        rss[i].append((now - start, tree_rss(proc.pid)))
                next_sample = now + 15
            if now >= next_kill and now + 60 < end:
                warm_at = warm_at if warm_at is not None else now - start
                proc = self.peers[victim]
                children = descendants(proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed_at = time.monotonic()
                while alive(children) and time.monotonic() - killed_at < 10:
                    time.sleep(0.2)
                left = alive(children)
                for pid in left:  # count them, then do not leave them to the next arm or the machine
                    os.kill(pid, signal.SIGKILL)
                log = self.workdir / f"peer{victim}.log"
                log_mark = log.stat().st_size
                self.start_peer(victim, initial)
                restarted_at = time.monotonic()
                # Watched for up to 120 s: the bootstrap's uncovered gauge every second (the victim's record
                # outlives it by up to record_ttl, so the gap may show only then), and the restarted peer's first
                # round applied in a group again.
                worst, last_uncovered, rejoined = 0, None, None
                while time.monotonic() - restarted_at < min(120.0, end - time.monotonic()):
                    count = uncovered(self.metrics_port)
                    if count:
                        worst, last_uncovered = max(worst, count), time.monotonic() - restarted_at
                    if rejoined is None and re.search(r"round \d+ applied at step \d+: shared group [2-9]",
                                                      log.read_text(errors="replace")[log_mark:]):
                        rejoined = time.monotonic() - restarted_at
                    time.sleep(1)
                restarts.append({"peer": victim, "at_min": (killed_at - start) / 60, "left_behind": len(left),
                                 "children": len(children), "max_uncovered": worst,
                                 "uncovered_until_s": last_uncovered, "rejoined_after_s": rejoined})
                logger.info(f"killed and restarted peer {victim}: {len(left)} of {len(children)} children left "
                            f"behind; at most {worst} expert(s) uncovered (until {last_uncovered} s after the "
                            f"restart); back in a group after {rejoined} s")
                victim = victim % (args.peers - 1) + 1
                next_kill += 60 * args.kill_every
            time.sleep(1)
        periods = [p for p in (self.round_period(i) for i in range(args.peers)) if p]
        codes = []
        for proc in self.peers:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.peers:
            if proc is not None:
                try:
                    codes.append(proc.wait(timeout=60))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes.append(proc.wait())
        nan = 0
        for i in range(args.peers):
            for line in (self.workdir / f"peer{i}" / "metrics.jsonl").read_text().splitlines():
                loss = json.loads(line).get("loss")
                nan += loss is None or not math.isfinite(float(loss))
        survivor = [(t, b) for t, b in rss[0] if warm_at is None or t >= warm_at]
        growth = survivor[-1][1] / survivor[0][1] - 1 if len(survivor) >= 2 else float("nan")
        return {"minutes": args.minutes, "peers": args.peers, "restarts": restarts, "exit_codes": codes,
                "nan_losses": nan, "survivor_rss_first_mib": survivor[0][1] / 2**20 if survivor else None,
                "survivor_rss_last_mib": survivor[-1][1] / 2**20 if survivor else None,
                "survivor_rss_growth": growth, "round_period_s": statistics.median(periods) if periods else None,
                "rss_samples": {i: v for i, v in rss.items()}}

    def close(self) -> None:
        procs = [p for p in [*self.peers, self.boot] if p is not None and p.poll() is None]
        for proc in procs:  # a clean stop first: each stops its own DHT process and p2pd
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for handle in self.logs:
            handle.close()


def table(result: dict) -> str:
    rows = [[str(r["peer"]), f"{r['at_min']:.1f}", f"{r['left_behind']} of {r['children']}",
             str(r["max_uncovered"]), "-" if r["uncovered_until_s"] is None else f"{r['uncovered_until_s']:.0f}",
             "not within 120 s" if r["rejoined_after_s"] is None else f"{r['rejoined_after_s']:.0f}"]
            for r in result["restarts"]]
    head = format_table(["killed peer", "at minute", "children left after 10 s", "max uncovered experts",
                         "uncovered until s after restart", "back in a group after s"], rows)
    period = result["round_period_s"]
    summary = format_table(["metric", "value"], [
        ["run", f"{result['peers']} peers, {result['minutes']:g} min, {len(result['restarts'])} SIGKILL + restart"],
        ["survivor RSS (peer 0 + children), first after warm-up", f"{result['survivor_rss_first_mib']:.0f} MiB"],
        ["survivor RSS, last", f"{result['survivor_rss_last_mib']:.0f} MiB"],
        ["survivor RSS growth", f"{100 * result['survivor_rss_growth']:+.1f} %"],
        ["round period (median over peers)", "n/a" if period is None else f"{period:.0f} s"],
        ["non-finite losses in metrics.jsonl", str(result["nan_losses"])],
        ["exit codes after the final SIGTERM", " ".join(map(str, result["exit_codes"]))],
    ])
    return head + "\n\n" + summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--kill-every", type=float, default=5.0, metavar="MINUTES")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--every", type=int, default=20, help="sync.every of the peers")
    p.add_argument("--out", type=Path, help="write table.md, result.json and the logs here")
    args = p.parse_args(argv)
    setup_logging()
    if args.peers < 2:
        p.error("--peers must be >= 2 (peer 0 is never killed)")
    workdir = args.out or Path(tempfile.mkdtemp(prefix="spes-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, workdir)
    try:
        result = soak.run()
    finally:
        soak.close()
    text = table(result)
    print(text)
    (workdir / "table.md").write_text(text + "\n")
    (workdir / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
