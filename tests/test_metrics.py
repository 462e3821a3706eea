"""Prometheus metrics (the README's table; the project spec's §4 where that file is at hand): exact names/types/labels, values that agree with metrics.jsonl, exact wire-byte
counting, the Grafana dashboard, and a real Prometheus server scraping a 2-peer swarm plus the bootstrap node."""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peer.callbacks import Callback
from peer.config import load_config, parse_override
from tests.conftest import REPO, peer_cmd

# The spec's peer metrics: exposed name -> (type, label names).
PEER_METRICS = {
    "spes_train_step": ("gauge", set()),
    "spes_train_loss": ("gauge", set()),
    "spes_tokens_total": ("counter", set()),
    "spes_tokens_per_second": ("gauge", set()),
    "spes_sync_rounds_total": ("counter", set()),
    "spes_sync_round_seconds": ("histogram", set()),
    "spes_sync_blocked_seconds_total": ("counter", set()),
    "spes_sync_bytes_sent_total": ("counter", {"kind"}),
    "spes_sync_bytes_received_total": ("counter", {"kind"}),
    "spes_owned_experts": ("gauge", set()),
    "spes_expert_owned": ("gauge", {"expert"}),
    "spes_peers": ("gauge", set()),
    "spes_merge_alpha": ("gauge", set()),
    "spes_rejected_tensors_total": ("counter", {"reason"}),
    "spes_parameters": ("gauge", {"kind"}),
}
# Beyond the spec (issue 9, "Visibility"): rounds in a row averaged with nobody, rollbacks after a bad round;
# (issue 13) relay reservations held.
EXTRA_PEER_METRICS = {
    "spes_sync_alone_rounds": ("gauge", set()),
    "spes_sync_rollbacks_total": ("counter", set()),
    "spes_relay_reservations": ("gauge", set()),  # issue 13: is a peer behind NAT reachable through a relay
    "spes_unserved_claims": ("gauge", set()),  # issue 32: ghost owners, claims with no deeds
}
# Served by the bootstrap node.
SWARM_METRICS = {"spes_swarm_peers", "spes_swarm_expert_replicas", "spes_swarm_tokens_total",
                 "spes_swarm_uncovered_experts", "spes_swarm_unserved_claims"}
SWARM_TYPES = {"spes_swarm_peers": ("gauge", set()), "spes_swarm_expert_replicas": ("gauge", {"expert"}),
               "spes_swarm_tokens_total": ("gauge", set()), "spes_swarm_uncovered_experts": ("gauge", set()),
               "spes_swarm_unserved_claims": ("gauge", set())}
# The project's spec sits beside the checkout in the developers' workspace (not in a clone).
SPEC_PATH = REPO.parent / "shared" / "SPEC.md"
# Asked for by issues 12 (coverage) and 32 (ghost owners), served in addition to the spec.
BEYOND_SPEC = {"spes_swarm_uncovered_experts", "spes_swarm_unserved_claims"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _exposed(text: str) -> dict[str, tuple[str, set[str], set[str]]]:
    """exposed name -> (type, label names, sample names) from a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(text):
        # The parser strips a counter's _total suffix from the family name; the exposed series keep it.
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        out[name] = (family.type, labels, {s.name for s in family.samples})
    return out


# ---- in-process: values, names, types, labels ----------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_peer(tmp_path_factory, offline_env):
    """One swarm peer (alone: sync on, nothing to average with) run to its end with metrics on; yields the node,
    a registry snapshot taken as each metrics.jsonl line was written, and the /metrics page after the run."""
    from peer.metrics import PeerMetrics
    from peer.node import PeerNode

    run_dir = tmp_path_factory.mktemp("metrics") / "run"
    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override(item) for item in (
        f"run_dir={run_dir}", "train.max_steps=12", "train.log_every=3", "train.eval_every=0",
        "train.checkpoint_every=0", "sync.every=4", "sync.matchmaking_time=1", "sync.round_timeout=10",
        "sync.merge.alpha=0.5", "sync.merge.decay_steps=100")])
    metrics = PeerMetrics(cfg.model.num_experts)
    port = _free_port()
    metrics.serve(port, addr="127.0.0.1")
    snapshots = []

    def snapshot(trainer) -> dict:
        snapshots.append({name: metrics.value(name) for name in (
            "spes_train_step", "spes_tokens_total", "spes_sync_rounds_total", "spes_sync_blocked_seconds_total")}
            | {f"{d}:{k}": metrics.value(f"spes_sync_bytes_{d}_total", kind=k)
               for d in ("sent", "received") for k in ("shared", "expert")})
        return {}

    try:
        with PeerNode(cfg, host_maddrs=["/ip4/127.0.0.1/tcp/0"], metrics=metrics) as node:
            class Snapshot(Callback):  # after the node's own callbacks: the same moment as the line
                def record_fields(self, trainer) -> dict:
                    return snapshot(trainer)

            node.trainer.add_callback(Snapshot())
            node.run()
            page = _scrape(port)
            yield SimpleNamespace(node=node, metrics=metrics, snapshots=snapshots, page=page, run_dir=run_dir)
    finally:
        metrics.shutdown()


def test_values_agree_with_metrics_jsonl(finished_peer):
    records = [json.loads(l) for l in (finished_peer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == len(finished_peer.snapshots) and records[-1]["step"] == 12
    for record, snap in zip(records, finished_peer.snapshots):
        assert snap["spes_train_step"] == record["step"]
        assert snap["spes_tokens_total"] == record["tokens"]
        assert snap["spes_sync_rounds_total"] == record["rounds"]
        assert snap["spes_sync_blocked_seconds_total"] == pytest.approx(record["blocked_s"])
        for direction in ("sent", "received"):
            for kind in ("shared", "expert"):
                assert snap[f"{direction}:{kind}"] == record[f"bytes_{direction}"][kind]
    m, trainer = finished_peer.metrics, finished_peer.node.trainer
    assert records[-1]["rounds"] >= 2
    # After the run: the end hook applied the last round; nothing trained after the last line.
    assert m.value("spes_train_step") == trainer.step == 12 and m.value("spes_tokens_total") == trainer.tokens
    assert m.value("spes_sync_rounds_total") == trainer.rounds
    assert m.value("spes_sync_round_seconds_count") == trainer.rounds  # one observation per round
    assert m.value("spes_sync_round_seconds_sum") > 0
    assert math.isfinite(m.value("spes_train_loss")) and 0 < m.value("spes_train_loss") < 10
    assert m.value("spes_tokens_per_second") > 0
    owned = sorted(trainer.model.owned_experts)
    assert m.value("spes_owned_experts") == len(owned) >= 1
    assert [m.value("spes_expert_owned", expert=str(e)) for e in range(4)] == [float(e in owned) for e in range(4)]
    assert m.value("spes_parameters", kind="total") == trainer.model.num_parameters("total")
    assert m.value("spes_parameters", kind="trainable") == trainer.model.num_parameters("trainable")
    assert m.value("spes_merge_alpha") == pytest.approx(0.5 * (1 - 12 / 100))  # warm-up coefficient at step 12
    assert m.value("spes_peers") == 1  # refreshed from the DHT at start: this peer's own record


def test_exposed_names_types_and_labels_are_exactly_spec(finished_peer):
    exposed = _exposed(finished_peer.page)
    assert set(exposed) == set(PEER_METRICS) | set(EXTRA_PEER_METRICS)
    for name, (kind, labels) in {**PEER_METRICS, **EXTRA_PEER_METRICS}.items():
        exposed_kind, exposed_labels, samples = exposed[name]
        assert (exposed_kind, exposed_labels) == (kind, labels), name
        if kind == "counter":
            assert samples == {name}, name  # no *_created series
        elif kind == "histogram":
            assert samples == {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    values = {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(finished_peer.page)
              for s in f.samples}
    for direction in ("sent", "received"):
        assert {l for n, l in values if n == f"spes_sync_bytes_{direction}_total"} == \
            {(("kind", "expert"),), (("kind", "shared"),)}
    assert {l for n, l in values if n == "spes_parameters"} == {(("kind", "total"),), (("kind", "trainable"),)}
    assert {l for n, l in values if n == "spes_expert_owned"} == {(("expert", str(e)),) for e in range(4)}
    from sync.validate import REJECT_REASONS
    assert {l for n, l in values if n == "spes_rejected_tensors_total"} == {(("reason", r),) for r in REJECT_REASONS}


def test_readme_table_lists_every_metric_with_its_type_and_labels():
    """Users read the metrics off the README's table: it must name exactly what is served, typed and labelled."""
    rows = re.findall(r"^\| `(spes_[a-z_]+)` \| (\w+) \|([^|]*)\|", (REPO / "README.md").read_text(), re.M)
    table = {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert len(rows) == len(table)
    assert table == {**PEER_METRICS, **EXTRA_PEER_METRICS, **SWARM_TYPES}
    assert set(SWARM_TYPES) == SWARM_METRICS


def test_spec_table_matches_this_list():
    """The names above are the spec's §4 (guards this test file against drifting from the spec)."""
    if not SPEC_PATH.exists():
        pytest.skip(f"{SPEC_PATH} is not part of this checkout")
    section = SPEC_PATH.read_text().split("## 4.", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`(spes_[a-z_]+)", section))
    assert names == set(PEER_METRICS) | SWARM_METRICS - BEYOND_SPEC


# ---- deploy/ -------------------------------------------------------------------------------------------------

def test_grafana_dashboard_uses_only_spec_metrics(tmp_path):
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\bspes_[a-z_]+", e)}
    assert used and used <= set(PEER_METRICS) | SWARM_METRICS, used - set(PEER_METRICS) - SWARM_METRICS
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    promtool = shutil.which("promtool")  # ships with the Prometheus server package
    if promtool:  # every query is valid PromQL: check them as recording rules
        rules = [{"record": f"spes_check:{i}", "expr": e.replace("$instance", ".*")} for i, e in enumerate(exprs)]
        path = tmp_path / "rules.yml"
        path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_prometheus_config_parses():
    import yaml
    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"spes-peers", "spes-bootstrap"} <= jobs
    promtool = shutil.which("promtool")  # ships with the Prometheus server package
    if promtool:
        proc = subprocess.run([promtool, "check", "config", str(REPO / "deploy" / "prometheus.yml")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- a real Prometheus server ----------------------------------------------------------------------------------

def _wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in {path}:\n{path.read_text()[-3000:] if path.exists() else ''}")


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
    except OSError:
        return []  # not up yet
    return body["data"]["result"] if body.get("status") == "success" else []


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: peers and the bootstrap node shut down cleanly
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_prometheus_scrapes_two_peers_and_the_bootstrap_node(tmp_path, processes):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("no Prometheus server binary (`apt-get install prometheus`; .ci/run installs it)")
    ports = {"bootstrap": _free_port(), "peer0": _free_port(), "peer1": _free_port(), "prometheus": _free_port()}
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen:
        procs.append(processes.start(cmd, log))  # reaped after the test, p2pd daemons included (tests/conftest.py)
        return procs[-1]

    try:
        boot_log = tmp_path / "bootstrap.log"
        boot = start([sys.executable, "-m", "dht_bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id",
                      "prom", "--num-experts", "4", "--metrics-port", str(ports["bootstrap"]), "--status-every", "2"],
                     boot_log)
        maddr = _wait_for_line(boot_log, r"initial peer: (\S+)", boot, 90).group(1)
        for i in range(2):
            start(peer_cmd("--config", "configs/tiny.yaml", "--initial-peers", maddr, "--host-maddrs",
                           "/ip4/127.0.0.1/tcp/0", "--run-id", "prom", "--run-dir", str(tmp_path / f"peer{i}"),
                           "--experts", str(i), "--max-steps", "100000", "--sync-every", "4",
                           "--metrics-port", str(ports[f"peer{i}"]), "--set", "sync.matchmaking_time=2",
                           "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0"),
                  tmp_path / f"peer{i}.log")
        targets = {name: f"127.0.0.1:{port}" for name, port in ports.items() if name != "prometheus"}
        config = tmp_path / "prometheus.yml"
        jobs = {"spes-peers": [targets["peer0"], targets["peer1"]], "spes-bootstrap": [targets["bootstrap"]]}
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in jobs.items()]}))
        start([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{ports['prometheus']}", "--log.level=warn"], tmp_path / "prom.log")

        checks = {
            "rounds": ("spes_sync_rounds_total", lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r)),
            "swarm peers": ("spes_swarm_peers", lambda r: len(r) == 1 and float(r[0]["value"][1]) == 2),
            "tokens/s": ("rate(spes_tokens_total[1m])",
                         lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r)),
            "all up": ("up", lambda r: len(r) == 3 and all(x["value"][1] == "1" for x in r)),
            # The peers own experts 0 and 1; nobody chose 2 and 3, so one of them adopts those (docs/DESIGN.md,
            # "Coverage"): in the end every expert has exactly one owner and none is uncovered.
            "replicas": ("spes_swarm_expert_replicas", lambda r: {x["metric"]["expert"]: x["value"][1] for x in r}
                         == {"0": "1", "1": "1", "2": "1", "3": "1"}),
            "uncovered": ("spes_swarm_uncovered_experts", lambda r: len(r) == 1 and r[0]["value"][1] == "0"),
        }
        results: dict[str, list] = {}
        deadline = time.time() + 240
        while time.time() < deadline:
            results = {name: _query(ports["prometheus"], promql) for name, (promql, _) in checks.items()}
            if all(ok(results[name]) for name, (_, ok) in checks.items()):
                break
            assert all(p.poll() is None for p in procs), [p.args[:4] for p in procs if p.poll() is not None]
            time.sleep(2)
        failed = [name for name, (_, ok) in checks.items() if not ok(results.get(name, []))]
        assert not failed, f"{failed}: {results}"
        instances = {x["metric"]["instance"] for x in results["rounds"]}
        assert instances == {targets["peer0"], targets["peer1"]}
    finally:
        for proc in reversed(procs):
            _stop(proc)  # SIGTERM: each shuts down cleanly (the fixture kills what is left after the test)
    left = processes.wait_all_gone()
    assert not left, f"processes left behind: {left}"
    for i in range(2):
        assert procs[1 + i].returncode == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    assert procs[0].returncode == 0, (tmp_path / "bootstrap.log").read_text()[-3000:]
