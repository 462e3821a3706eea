"""Convergence at equal tokens: SPES vs centralized vs DiLoCo, every peer a real swarm member.

    python -m bench.convergence                      # all 7 arms, the default scale (2 CPU cores: ~45 min)
    python -m bench.convergence --scale smoke --arms centralized,spes --peers 2     # the CI smoke version
    python -m bench.convergence --arms spes_nomerge --alpha-sweep 0.05,0.2,0.5     # the merge alpha sweep

Each swarm arm starts a plain `hivemind-dht` bootstrap and `--peers` separate `python -m peer.run` processes on
127.0.0.1 (real DHT, real contribution rounds: each peer serves one blob and aggregates everyone's) with one
torch thread each; the centralized arm is one `peer.run` process with the whole global batch and no sync. All
arms see the same total tokens, the same model shape, the same schedule and the same held-out blocks. Rounds
are blocking (`sync.overlap: false`) and held-out loss is evaluated right after each round (eval_every = H), so
every peer evaluates the synchronized model; the swarm's loss at a step is the mean over its peers.

Reported per arm: held-out loss at 25/50/100 % of the token budget, ratio to centralized, wall time, CPU seconds
(all processes of the arm, from wait4: robust to other load on the machine, unlike wall time), peak RSS of the
largest peer process, tensor bytes per peer (sent + received, from the peers' metrics.jsonl), and the smallest
round group seen (contributions a peer aggregated; a round with fewer than --peers means a peer missed it: a
flawed run). Every swarm arm runs the contribution protocol with the run's default codec (`sync.compression:
sparse`) unless its overrides say otherwise (`spes_fp32`: uncompressed fp32 contributions).
Writes results.json, table.md and two PNGs (loss vs tokens, loss vs wall time) into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.common import REPO_ROOT, format_table, logger, setup_logging

# Shapes: "default" ~3.5 M parameters (8 experts top-2), trains meaningfully on 2 CPU cores in minutes per arm.
SCALES: dict[str, dict[str, Any]] = {
    "smoke": dict(model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, expert_hidden=128,
                             seq_len=64), batch=8, steps=20, every=10, eval_blocks=32, threads=1),
    "default": dict(model=dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, num_experts=8, expert_hidden=256,
                               seq_len=128), batch=16, steps=600, every=50, eval_blocks=256, threads=1),
    # For a bigger machine (one GPU or many cores): ~60 M parameters, 16 experts.
    "large": dict(model=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, num_experts=16, expert_hidden=1024,
                             seq_len=512), batch=16, steps=4000, every=100, eval_blocks=512, threads=0),
}


@dataclass
class Arm:
    """One training setup: how many peers, which experts each owns, and config overrides."""
    name: str
    label: str
    peers: int
    experts: list[str]                       # --experts for each peer
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0                            # train.seed: the initial model and every peer's data order

    @property
    def key(self) -> str:
        """Run directory and result key: the name, with the seed unless it is 0 (older results had none)."""
        return self.name if self.seed == 0 else f"{self.name}-s{self.seed}"


def _split(num_experts: int, peers: int, replication: int) -> list[str]:
    """Peer i owns a contiguous block; `replication` peers share each block (as the paper's reference: node p owns p*m..p*m+m-1)."""
    groups = peers // replication
    if groups == 0 or num_experts % groups:
        raise ValueError(f"{num_experts} experts cannot be split over {groups} groups of {replication} peers")
    m = num_experts // groups
    return [f"{(i // replication) * m}-{(i // replication) * m + m - 1}" for i in range(peers)]


def merge_settings(alpha: float, steps: int, every: int, topk: int) -> dict[str, Any]:
    """Paper-like warm-up scaled to this run: every 2 rounds, alpha decayed to 0 over the first 40 % of steps."""
    return {"interval": 2 * every, "alpha": alpha, "decay_steps": max(1, int(0.4 * steps)), "topk": topk}


def build_arms(names: list[str], scale: dict[str, Any], peers: int, alphas: list[float]) -> list[Arm]:
    E, steps, every = scale["model"]["num_experts"], scale["steps"], scale["every"]
    topk = max(1, E // 4)  # the reference's k = 4 of 16 experts, scaled to this expert count
    merge_on = {"sync": {"merge": merge_settings(0.05, steps, every, topk)}}
    merge_off = {"sync": {"merge": merge_settings(0.0, steps, every, topk)}}
    spes = _split(E, peers, 1)
    # The bigger MoE of the equal-memory pair: twice the experts (same per-token compute with top-k routing),
    # no merge warm-up (it did not help at any alpha0 here); each peer owns a quarter of them.
    big = {"model": {"num_experts": 2 * E}, "sync": {"merge": merge_settings(0.0, steps, every, max(1, E // 2))}}
    catalog = {
        "centralized": lambda: Arm("centralized", "centralized (1 peer, global batch)", 1, ["all"],
                                   {"sync": {"every": 0}}),
        "diloco": lambda: Arm("diloco", f"DiLoCo ({peers} peers, all experts, avg)", peers, ["all"] * peers, merge_off),
        "spes": lambda: Arm("spes", "SPES (merge warm-up)", peers, spes, merge_on),
        # Uncompressed SPES: fp32 contributions (sync.compression: none), the baseline of the codec arms.
        "spes_fp32": lambda: Arm("spes_fp32", "SPES, contributions, fp32", peers, spes,
                                 _deep_merge(merge_on, {"sync": {"compression": "none"}})),
        "spes_nomerge": lambda: Arm("spes_nomerge", "SPES, no merge", peers, spes, merge_off),
        "spes_nesterov": lambda: Arm("spes_nesterov", "SPES + Nesterov outer", peers, spes,
                                     _deep_merge(merge_on, {"sync": {"outer": "nesterov"}})),
        "spes_repl2": lambda: Arm("spes_repl2", "SPES, replication 2", peers, _split(E, peers, 2), merge_on),
        # Rounds of C drawn contributions (sync/draw.py): half the peers contribute to a round, the others drop it.
        "spes_repl2_drawn": lambda: Arm("spes_repl2_drawn",
                                        f"SPES, replication 2, {max(1, peers // 2)} drawn per round",
                                        peers, _split(E, peers, 2),
                                        _deep_merge(merge_on, {"sync": {"contributors": max(1, peers // 2)}})),
        "spes_decayedlb": lambda: Arm("spes_decayedlb", "SPES + decayed LB loss", peers, spes,
                                      _deep_merge(merge_on, {"train": {"decayed_lb": True}})),
        # Lever: a training-only routing bias toward the peer's own experts, 1.0 on the logits decayed to 0 by the
        # end (train.own_expert_bias), against spes_nomerge.
        "spes_ownbias": lambda: Arm("spes_ownbias", "SPES, no merge, own-expert bias 1 -> 0", peers, spes,
                                    _deep_merge(merge_off, {"train": {"own_expert_bias": 1.0}})),
        # The sparse codec (sync/sparse.py) at top-64/128/256, the unsent residual kept in the live model or held
        # as error feedback (the default codec is top-256, kept: spes_sparse_keep256 is `spes`'s setting).
        "spes_sparse": lambda: Arm("spes_sparse", "SPES, contributions, top-64, error feedback", peers, spes,
                                   _sparse_arm(merge_on, 64, keep=False)),
        "spes_sparse_keep": lambda: Arm("spes_sparse_keep", "SPES, contributions, top-64, residual kept", peers,
                                        spes, _sparse_arm(merge_on, 64, keep=True)),
        "spes_sparse256": lambda: Arm("spes_sparse256", "SPES, contributions, top-256, error feedback", peers, spes,
                                      _sparse_arm(merge_on, 256, keep=False)),
        "spes_sparse_keep256": lambda: Arm("spes_sparse_keep256", "SPES, contributions, top-256, residual kept",
                                           peers, spes, _sparse_arm(merge_on, 256, keep=True)),
        "spes_sparse_keep128": lambda: Arm("spes_sparse_keep128", "SPES, contributions, top-128, residual kept",
                                           peers, spes, _sparse_arm(merge_on, 128, keep=True)),
        "spes_big": lambda: Arm("spes_big", f"SPES, no merge, {2 * E} experts", peers, _split(2 * E, peers, 1), big),
        # Resolved in main() by measuring memory (bench/fit.py): DiLoCo on the largest MoE that fits spes_big's peer.
        "diloco_eqmem": lambda: Arm("diloco_eqmem", "DiLoCo at SPES-big's memory", peers, ["all"] * peers, merge_off),
    }
    arms = []
    for name in names:
        # A lever beyond the seven: sync more often. `spes_hN` / `diloco_hN` = no merge, H = N (N must
        # divide the scale's H, so that evaluations still fall right after a round).
        match = re.fullmatch(r"(spes|diloco)_h(\d+)", name)
        if match:
            h = int(match.group(2))
            if h <= 0 or every % h:
                raise ValueError(f"arm {name}: H = {h} must divide the evaluation interval {every}")
            kind = match.group(1)
            arms.append(Arm(name, f"{'SPES' if kind == 'spes' else 'DiLoCo'}, no merge, H = {h}", peers,
                            spes if kind == "spes" else ["all"] * peers,
                            _deep_merge(merge_off, {"sync": {"every": h}})))
            continue
        if name not in catalog:
            raise ValueError(f"unknown arm {name!r}; choose from {', '.join(catalog)}")
        arms.append(catalog[name]())
    for alpha in alphas:
        arms.append(Arm(f"spes_alpha{alpha:g}", f"SPES, merge alpha0 {alpha:g}", peers, spes,
                        {"sync": {"merge": merge_settings(alpha, steps, every, topk)}}))
    return arms


def _deep_merge(base: dict, extra: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in extra.items():
        out[key] = _deep_merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _sparse_arm(base: dict[str, Any], topk: int, keep: bool) -> dict[str, Any]:
    """Contributions with the sparse codec at top-`topk` of 4096, the unsent residual kept live or not."""
    return _deep_merge(base, {"sync": {"compression": "sparse",
                                       "sparse": {"topk": topk, "keep_residual": keep}}})


def arm_config(arm: Arm, scale: dict[str, Any], peers: int) -> dict[str, Any]:
    """The YAML config of one arm's peers. Equal tokens: the centralized batch is the sum of the swarm's."""
    batch = scale["batch"] * (peers if arm.peers == 1 else 1)
    cfg = {
        "run_id": f"bench-{arm.name.replace('.', 'p')}",  # run ids may not contain dots (DHT keys)
        "model": dict(scale["model"], vocab_size=320, top_k=2, frozen_expert_dtype="bfloat16"),
        "train": {"batch_size": batch, "lr": 0.003, "warmup_steps": max(1, scale["steps"] // 10),
                  "max_steps": scale["steps"], "seed": arm.seed, "log_every": scale["every"],
                  "eval_every": scale["every"], "eval_batches": max(1, scale["eval_blocks"] // batch),
                  "checkpoint_every": 0},
        "data": {"dataset": "builtin", "tokenizer": "builtin"},
        # A round ends once every peer's contribution is in; the long waits for announcements and blobs only
        # matter when a peer is late (a loaded machine), and then keep it in the round.
        "sync": {"every": scale["every"], "outer": "avg", "overlap": False,
                 "matchmaking_time": 20.0, "round_timeout": 90.0,
                 "wait_for_peers": peers},  # nobody trains (and syncs alone) before all peers are there
    }
    return _deep_merge(cfg, arm.overrides)


def resolve_equal_memory(arms: list[Arm], scale: dict[str, Any], peers: int,
                         cached: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Give `diloco_eqmem` its model: the most experts for which a DiLoCo peer (owning all) peaks within the
    model memory a `spes_big` peer measured (bench/fit.py; both at the arm's batch and sequence length)."""
    from bench.fit import largest_fitting, measure

    eq = [a for a in arms if a.name == "diloco_eqmem"]
    if not eq:
        return cached
    if cached is not None:
        for arm in eq:
            arm.overrides = _deep_merge(arm.overrides, {"model": {"num_experts": cached["diloco_experts"]}})
            arm.label = f"DiLoCo, {cached['diloco_experts']} experts (SPES-big's memory)"
        return cached
    big = build_arms(["spes_big"], scale, peers, [])[0]
    budget = measure(arm_config(big, scale, peers), big.experts[0])
    top_k = arm_config(big, scale, peers)["model"]["top_k"]

    def cfg_for(E: int) -> dict[str, Any]:
        return arm_config(Arm("fit", "", peers, ["all"] * peers, {"model": {"num_experts": E}}), scale, peers)

    E, seen = largest_fitting(cfg_for, budget["model_peak"], top_k, 2 * scale["model"]["num_experts"])
    for arm in eq:
        arm.overrides = _deep_merge(arm.overrides, {"model": {"num_experts": E}})
        arm.label = f"DiLoCo, {E} experts (SPES-big's memory)"
    logger.info(f"equal memory: a spes_big peer needs {budget['model_peak'] / 2**20:.0f} MiB; DiLoCo fits {E} experts")
    return {"spes_big_peak": budget["model_peak"], "diloco_experts": E,
            "measured": {str(k): v["model_peak"] for k, v in sorted(seen.items())}}


_PEAKS: dict[str, dict[str, Any]] = {}


def peer_memory(arm: Arm, scale: dict[str, Any], peers: int) -> dict[str, Any]:
    """bench/fit.py's model memory of the arm's first peer (the seed and run id do not change it: cached)."""
    from bench.fit import measure

    cfg = arm_config(arm, scale, peers)
    cfg["run_id"], cfg["train"]["seed"] = "fit", 0
    key = json.dumps([cfg, arm.experts[0]], sort_keys=True)
    if key not in _PEAKS:
        _PEAKS[key] = measure(cfg, arm.experts[0])
    return _PEAKS[key]


def _start_bootstrap(log_path: Path) -> tuple[subprocess.Popen, str]:
    """A plain hivemind DHT node as the arm's bootstrap; returns it and its multiaddr."""
    exe = shutil.which("hivemind-dht") or str(Path(sys.executable).parent / "hivemind-dht")
    log = open(log_path, "w")
    proc = subprocess.Popen([exe, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, await_address(proc, log_path, r"--initial_peers (\S+)", "hivemind-dht")


def await_address(proc: subprocess.Popen, log_path: Path, pattern: str, name: str, timeout: float = 60) -> str:
    """The multiaddr a starting node prints into its log (`pattern`'s group 1); stops it and raises if it exits or
    prints none within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log_path.read_text(errors='replace')[-500:]}")
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"{name} did not print its address within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s; its process group too (the DHT's p2pd)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_rusage(procs: list[subprocess.Popen], timeout: float) -> list[dict[str, float]]:
    """Wait for every process; per process: exit code, CPU seconds (with its waited children: DHT, p2pd)
    and peak RSS (largest of it and its children), from wait4."""
    deadline = time.monotonic() + timeout
    results: dict[int, dict[str, float]] = {}
    while len(results) < len(procs):
        for proc in procs:
            if proc.pid in results:
                continue
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                results[pid] = {"rc": proc.returncode, "cpu_s": ru.ru_utime + ru.ru_stime,
                                "maxrss": ru.ru_maxrss * 1024}
        if time.monotonic() > deadline:
            for proc in procs:
                if proc.pid not in results:
                    os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"arm did not finish within {timeout:.0f} s")
        time.sleep(0.5)
    return [results[p.pid] for p in procs]


def run_arm(arm: Arm, scale: dict[str, Any], peers: int, out: Path, timeout: float) -> dict[str, Any]:
    """Run one arm to the end; returns its curves and costs."""
    arm_dir = out / arm.key
    memory = peer_memory(arm, scale, peers)
    shutil.rmtree(arm_dir, ignore_errors=True)
    arm_dir.mkdir(parents=True)
    cfg_path = arm_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(arm_config(arm, scale, peers), sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS=str(scale["threads"] or os.cpu_count()), PYTHONUNBUFFERED="1")
    bootstrap, maddr = (None, None)
    procs: list[subprocess.Popen] = []
    started = time.time()
    try:
        if arm.peers > 1:
            bootstrap, maddr = _start_bootstrap(arm_dir / "bootstrap.log")
            started = time.time()
        for i in range(arm.peers):
            cmd = [sys.executable, "-m", "peer.run", "--config", str(cfg_path), "--run-dir", str(arm_dir / f"peer{i}"),
                   "--experts", arm.experts[i], "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
            if maddr:
                cmd += ["--initial-peers", maddr]
            log = open(arm_dir / f"peer{i}.log", "w")
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        usage = _wait_rusage(procs, timeout)
        wall = time.time() - started
    finally:
        for proc in procs:
            _stop(proc)
        if bootstrap is not None:
            _stop(bootstrap)
    failed = [i for i, u in enumerate(usage) if u["rc"] != 0]
    if failed:
        tail = (arm_dir / f"peer{failed[0]}.log").read_text()[-1500:]
        raise RuntimeError(f"arm {arm.name}: peer(s) {failed} exited non-zero:\n{tail}")
    result = summarize(arm, arm_dir, started, wall, usage)
    result.update(seed=arm.seed, key=arm.key, model_peak=memory["model_peak"], params_total=memory["params_total"],
                  num_experts=memory["num_experts"])
    return result


def summarize(arm: Arm, arm_dir: Path, started: float, wall: float, usage: list[dict[str, float]]) -> dict[str, Any]:
    """Curves (swarm tokens, wall seconds, mean held-out loss over peers) and costs of a finished arm."""
    per_peer = []
    for i in range(arm.peers):
        lines = (arm_dir / f"peer{i}" / "metrics.jsonl").read_text().splitlines()
        per_peer.append([json.loads(l) for l in lines if l.strip()])
    evals: dict[int, list[dict]] = {}
    for records in per_peer:
        for r in records:
            if "eval_loss" in r:
                evals.setdefault(r["step"], []).append(r)
    curve = [{"step": step, "tokens": sum(r["tokens"] for r in rs), "seconds": max(r["time"] for r in rs) - started,
              "eval_loss": sum(r["eval_loss"] for r in rs) / len(rs)}
             for step, rs in sorted(evals.items()) if len(rs) == arm.peers]
    bytes_per_peer = []
    for i, records in enumerate(per_peer):
        last = next((r for r in reversed(records) if "bytes_sent" in r), None)
        if last is not None:
            bytes_per_peer.append(sum(last["bytes_sent"].values()) + sum(last["bytes_received"].values()))
            continue
        # Older builds log the totals once at the end: "tensor bytes on the wire (sent + received): {...}".
        logged = re.findall(r"bytes on the wire \(sent \+ received\): (\{[^}]*\})", (arm_dir / f"peer{i}.log").read_text())
        if logged:
            bytes_per_peer.append(sum(json.loads(logged[-1].replace("'", '"')).values()))
    groups = [int(g) for i in range(arm.peers)
              for g in re.findall(r"shared group (\d+)", (arm_dir / f"peer{i}.log").read_text())]
    return {"arm": arm.name, "label": arm.label, "peers": arm.peers, "experts": arm.experts, "curve": curve,
            "wall_s": wall, "cpu_s": sum(u["cpu_s"] for u in usage), "peak_rss": max(u["maxrss"] for u in usage),
            "bytes_per_peer": (sum(bytes_per_peer) / len(bytes_per_peer)) if bytes_per_peer else None,
            "min_group": min(groups) if groups else None, "rounds": len(groups) // max(arm.peers, 1)}


def loss_at(curve: list[dict], fraction: float) -> float | None:
    """Held-out loss at the last evaluation within `fraction` of the token budget."""
    if not curve:
        return None
    budget = curve[-1]["tokens"]
    inside = [p for p in curve if p["tokens"] <= fraction * budget * 1.0001]
    return inside[-1]["eval_loss"] if inside else None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def table(results: list[dict[str, Any]]) -> str:
    """One row per arm; an arm run with several seeds shows their mean and spread (max - min) at 100 %."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    final = {name: [loss_at(r["curve"], 1.0) for r in runs] for name, runs in by_arm.items()}
    ref = {name: _mean(final[name]) for name in ("centralized", "diloco")
           if name in final and None not in final[name]}
    rows = []
    for name, runs in by_arm.items():
        losses = [[loss_at(r["curve"], f) for r in runs] for f in (0.25, 0.5, 1.0)]
        mean = [_mean(l) if None not in l else None for l in losses]
        seeds = ",".join(str(r.get("seed", 0)) for r in runs)
        spread = max(losses[2]) - min(losses[2]) if len(runs) > 1 and mean[2] is not None else None
        bytes_ = [r["bytes_per_peer"] for r in runs if r["bytes_per_peer"] is not None]
        groups = [r["min_group"] for r in runs if r["min_group"] is not None]
        rows.append([runs[0]["label"], seeds,
                     f"{runs[0]['params_total'] / 1e6:.1f}" if runs[0].get("params_total") else "-",
                     *(f"{l:.4f}" if l is not None else "-" for l in mean),
                     f"{spread:.4f}" if spread is not None else "-",
                     *(f"{mean[2] / ref[k]:.3f}" if (k in ref and mean[2]) else "-" for k in ("centralized", "diloco")),
                     f"{runs[0]['model_peak'] / 2**20:.0f}" if runs[0].get("model_peak") else "-",
                     f"{_mean([r['wall_s'] for r in runs]):.0f}", f"{_mean([r['cpu_s'] for r in runs]):.0f}",
                     f"{_mean(bytes_) / 2**20:.1f}" if bytes_ else "-",
                     f"{min(groups)}/{runs[0]['peers']}" if groups else "-"])
    return format_table(["arm", "seeds", "params M", "loss@25%", "loss@50%", "loss@100%", "spread@100%",
                         "÷ central", "÷ DiLoCo", "model MiB/peer", "wall s", "CPU s", "MiB/peer", "min group"], rows)


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """Held-out loss vs swarm tokens and vs wall time, all arms on one figure each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, name in (("tokens", "tokens trained (all peers, millions)", "convergence_tokens.png"),
                              ("seconds", "wall time (s)", "convergence_wall.png")):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
        colors = plt.get_cmap("tab20").colors
        names = list(dict.fromkeys(r["arm"] for r in results))
        for r in results:
            i = names.index(r["arm"])
            xs = [p[key] / (1e6 if key == "tokens" else 1) for p in r["curve"]]
            # Centralized in black, DiLoCo arms dashed, SPES arms solid: 11 arms stay tellable apart; one colour
            # per arm, its other seeds fainter.
            style = dict(color="black", linewidth=2.2) if r["arm"] == "centralized" else \
                dict(color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20],
                     linestyle="--" if r["arm"].startswith("diloco") else "-")
            if r.get("seed"):
                style["alpha"] = 0.55
            label = r["label"] + (f" (seed {r['seed']})" if r.get("seed") else "")
            ax.plot(xs, [p["eval_loss"] for p in r["curve"]], marker=".", label=label, **style)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        paths.append(out / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="default", help="model shape and token budget")
    p.add_argument("--arms", default="centralized,diloco,spes,spes_nomerge,spes_nesterov,spes_repl2,spes_decayedlb",
                   help="comma list of arms to run, in order")
    p.add_argument("--equal-memory", action="store_true",
                   help="the equal-memory pair only: spes_big and diloco_eqmem (same as --arms spes_big,diloco_eqmem)")
    p.add_argument("--seeds", default="0", help="comma list of train.seed values: every arm runs once per seed")
    p.add_argument("--alpha-sweep", default="", help="comma list of merge alpha0 values: one extra SPES arm each")
    p.add_argument("--peers", type=int, default=4, help="peers per swarm arm")
    p.add_argument("--steps", type=int, help="local steps per peer (default: the scale's)")
    p.add_argument("--every", type=int, help="sync every H steps (default: the scale's)")
    p.add_argument("--out", default="bench/results/convergence", help="where logs, results.json, table and PNGs go")
    p.add_argument("--arm-timeout", type=float, default=3600, help="seconds before an arm is killed")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rewrite the table and PNGs from --out/results.json")
    p.add_argument("--resume", action="store_true",
                   help="keep the arms already in --out/results.json (same scale and peers) and run only the others")
    args = p.parse_args(argv)
    setup_logging()
    scale = dict(SCALES[args.scale])
    scale["steps"] = args.steps or scale["steps"]
    scale["every"] = args.every or scale["every"]
    alphas = [float(a) for a in args.alpha_sweep.split(",") if a.strip()]
    names = ["spes_big", "diloco_eqmem"] if args.equal_memory else [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    base = build_arms(names, scale, args.peers, alphas)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    previous = out / "results.json"
    saved = json.loads(previous.read_text()) if previous.exists() and (args.resume or args.replot) else {}
    resuming = bool(args.resume and saved and saved["scale"] == scale and saved["peers"] == args.peers)
    if args.replot or resuming:
        results = list(saved["results"])  # every arm saved, listed now or not: one table grows run by run
        logger.info(f"kept {[r.get('key', r['arm']) for r in results]} from {previous}")
    fit_path = out / "fit.json"
    if not args.replot:
        # A resumed run keeps the model size found before: its other seeds must train the same model.
        cached = json.loads(fit_path.read_text()) if resuming and fit_path.exists() else None
        fit = resolve_equal_memory(base, scale, args.peers, cached)
        if fit is not None:
            fit_path.write_text(json.dumps(fit, indent=1))
    arms = [Arm(a.name, a.label, a.peers, a.experts, a.overrides, seed) for seed in seeds for a in base]
    done = {r.get("key", r["arm"]) for r in results}
    for arm in arms if not args.replot else []:
        if arm.key in done:
            continue
        logger.info(f"arm {arm.key}: {arm.peers} peer(s), experts {arm.experts}")
        results.append(run_arm(arm, scale, args.peers, out, args.arm_timeout))
        logger.info(f"arm {arm.key} done in {results[-1]['wall_s']:.0f}s")
        (out / "results.json").write_text(json.dumps({"scale": scale, "peers": args.peers, "results": results}, indent=1))
    order = {a.name: i for i, a in enumerate(base)}
    results.sort(key=lambda r: (order.get(r["arm"], len(order)), r.get("seed", 0)))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    for path in plot(results, out):
        logger.info(f"wrote {path}")
    sys.stdout.write(f"scale {args.scale}: {scale['model']}, batch {scale['batch']} x {args.peers} peers, "
                     f"{scale['steps']} steps, H = {scale['every']}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
