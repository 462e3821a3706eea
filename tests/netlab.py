"""Network-emulation lab: Linux network namespaces, veth links, `tc tbf` rate limits and an nftables NAT.

A `NetLab` builds a small internet out of namespaces, all of it private to the lab:

* a **hub** namespace holding a bridge: the "public internet" (10.213.0.0/24). Every public node has one veth
  pair to it, so public nodes can dial each other;
* **public** nodes: a namespace with ``eth0`` = 10.213.0.N/24 and no default route (nothing can leave the lab);
* **home** nodes: a home namespace (``eth0`` = 10.213.H.2/24, default route via its router) behind a **router**
  namespace (``lan0`` = 10.213.H.1, ``wan0`` = 10.213.0.N on the hub) that masquerades LAN traffic to the WAN
  and drops every unsolicited inbound packet — a home NAT without port forwarding.

Each node's access link (a public node's veth to the hub, a home's router WAN veth) can be rate-limited with
`tc tbf` in both directions (egress of each veth end) and cut/restored (`ip link set ... down/up`, for partition
tests). Processes run inside a namespace via ``ip netns exec`` in their own session, so `NetLab.close` can kill
their whole process group (hivemind forks p2pd and DHT children) before it deletes the namespaces.

Only addresses inside the lab's own namespaces are ever configured, and no namespace has a route out of the lab.
The "public" net is RFC 1918 space, so libp2p treats every lab address as private: AutoNAT never confirms public
reachability and autorelay does not advertise circuit addresses through such relays. tests/netlab_p2p.py's
`RELAY_SERVER_KWARGS` / `relay_client_options` hold the settings that make NAT traversal work in spite of that.

Use it as a context manager (``with NetLab() as lab: ...``) or through the `netlab` pytest fixture; both tear
everything down on failure too. `netlab_unavailable` says why the lab cannot run here (not root, a tool missing,
no permission to create namespaces); the fixture turns that into a clean ``pytest.skip``.

A second module, ``tests/netlab_p2p.py``, is a small hivemind.P2P process driven over stdin/stdout that tests and
benchmarks run inside the namespaces.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, Sequence

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

REPO = Path(__file__).resolve().parent.parent
PUBLIC_NET = "10.213.0"  # the emulated internet: 10.213.0.0/24 on the hub's bridge
HOME_NET_BASE = 100  # home LANs are 10.213.(100 + i).0/24
CMD_TIMEOUT = 15.0  # every `ip`/`tc`/`nft` call is capped: a wedged netlink call must not hang a test run
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL at teardown (lets hivemind shut p2pd down cleanly)

OWNERS_DIR = Path("/run/netlab")  # one file per live lab: its namespace prefix -> the owning process's pid

_live_labs: "set[NetLab]" = set()


class NetLabError(RuntimeError):
    """A namespace/link/qdisc/nft command failed."""


def _run(argv: Sequence[str], *, timeout: float = CMD_TIMEOUT, check: bool = True,
         input: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run one configuration command; raise NetLabError with its stderr if it fails."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    except subprocess.TimeoutExpired as e:
        raise NetLabError(f"timed out after {timeout}s: {' '.join(argv)}") from e
    if check and res.returncode != 0:
        raise NetLabError(f"{' '.join(argv)} -> rc {res.returncode}: {res.stderr.strip()}")
    return res


_unavailable_cache: Optional[tuple[Optional[str]]] = None


def netlab_unavailable() -> Optional[str]:
    """None if namespaces, veths, tbf and nftables work here; otherwise a human-readable reason (for skips)."""
    global _unavailable_cache
    if _unavailable_cache is not None:
        return _unavailable_cache[0]
    reason: Optional[str] = None
    if sys.platform != "linux":
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "network-namespace tests need root (ip netns / tc / nft)"
    else:
        missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
        if missing:
            reason = f"missing {', '.join(missing)}: apt-get install -y iproute2 nftables"
    if reason is None:
        # Root in a container may still lack CAP_SYS_ADMIN/CAP_NET_ADMIN: probe once with a throwaway namespace.
        probe = f"nlprobe-{secrets.token_hex(3)}"
        try:
            _run(["ip", "netns", "add", probe])
            try:
                _run(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
                _run(["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit",
                      "burst", "64kb", "latency", "50ms"])
                _run(["ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe"])
            finally:
                _run(["ip", "netns", "del", probe], check=False)
        except NetLabError as e:
            reason = f"cannot build network namespaces here: {e}"
    _unavailable_cache = (reason,)
    return reason


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(ns: str) -> None:
    """Kill whatever still runs inside `ns` (ours by construction), then delete it with its veths/qdiscs/rules."""
    res = _run(["ip", "netns", "pids", ns], check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    res = _run(["ip", "netns", "del", ns], check=False)
    if res.returncode != 0:
        logger.warning(f"netlab: ip netns del {ns}: {res.stderr.strip()}")


def reap_stale_labs() -> list[str]:
    """Delete labs whose owning process died without `close` (SIGKILL, OOM); returns the namespaces removed.

    Only labs registered in OWNERS_DIR with a dead owner pid are touched, so concurrent live labs (another test
    session on this machine) and namespaces that are not ours are left alone."""
    removed: list[str] = []
    if not OWNERS_DIR.is_dir():
        return removed
    for owner_file in OWNERS_DIR.glob("nl*"):
        try:
            pid = int(owner_file.read_text().split()[0])
            os.kill(pid, 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except (OSError, ValueError, IndexError):
            continue  # unreadable or foreign entry: leave it alone
        prefix = owner_file.name
        for ns in _netns_names():
            if ns.startswith(prefix + "-"):
                _delete_namespace(ns)
                removed.append(ns)
        owner_file.unlink(missing_ok=True)
    if removed:
        logger.warning(f"netlab: removed namespaces of dead labs: {removed}")
    return removed


def _free_lab_id() -> str:
    """4 hex digits not used by another live lab on this machine (names are global: /run/netns/nl<id>-*)."""
    for _ in range(100):
        lab_id = secrets.token_hex(2)
        if not Path(f"/run/netns/nl{lab_id}-hub").exists():
            return lab_id
    raise NetLabError("no free lab id")


@dataclass
class Link:
    """One veth access link between a node-side interface and the hub's bridge."""
    ns: str  # namespace holding the node-side end
    dev: str  # node-side device name (eth0 for public nodes, wan0 for routers)
    hub_dev: str  # hub-side device name (enslaved to the bridge)
    up_mbit: Optional[float] = None  # egress of `dev` (upload of the node)
    down_mbit: Optional[float] = None  # egress of `hub_dev` (download of the node)


@dataclass
class Node:
    """A host in the lab: `ns` is the namespace to run things in, `ip` the address others dial."""
    name: str
    ns: str
    ip: str
    kind: str  # "public" | "home"
    link: Link  # the access link to the public hub (a home node's is its router's WAN link)
    router_ns: Optional[str] = None  # home nodes only
    wan_ip: Optional[str] = None  # home nodes only: the router's public address (what others observe)


class NsProcess:
    """A process started inside a namespace in its own session; stdout lines are queued for `expect`."""

    def __init__(self, argv: Sequence[str], ns: str, log_path: Path, env: Optional[dict] = None,
                 stdin: bool = False):
        self.ns = ns
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[str] = open(log_path, "w")
        self.popen = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=self._log,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True, bufsize=1,
            env=env, start_new_session=True,  # own process group: close() kills p2pd and forked children too
        )
        self.pid = self.popen.pid
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stdout_lines: list[str] = []
        self.ready: dict = {}  # set by NetLab.p2p_agent: the agent's "ready" reply
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        try:
            for line in self.popen.stdout:
                line = line.rstrip("\n")
                self.stdout_lines.append(line)
                self.lines.put(line)
        except (OSError, ValueError):  # kill() closed the pipe under us
            pass
        self.lines.put(None)  # EOF marker

    def expect(self, pattern: str, timeout: float) -> re.Match:
        """Wait for a stdout line matching `pattern` (regex search); raise TimeoutError/EOFError otherwise."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line matching {pattern!r} within {timeout}s from {self.argv[:3]}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.lines.put(None)
                raise EOFError(f"process exited (rc={self.popen.poll()}) before printing {pattern!r}; "
                               f"log {self.log_path}:\n{self.log_tail()}")
            m = rx.search(line)
            if m:
                return m

    def wait_log(self, pattern: str, timeout: float) -> re.Match:
        """Wait for `pattern` (multiline regex) in the process's log file (peer.run and dht_bootstrap log to
        stderr, which goes there); raise if the process exits or `timeout` passes first."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.log_path.read_text(errors="replace"))
            if m:
                return m
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in {self.argv[:4]} (rc={self.popen.poll()}):\n"
                                     f"{self.log_tail(60)}")
            time.sleep(0.3)

    def send(self, line: str) -> None:
        """Write one line to the process's stdin (started with stdin=True)."""
        assert self.popen.stdin is not None, "process was started without stdin=True"
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def request(self, op: str, reply_timeout: float, **kwargs) -> dict:
        """JSON-lines RPC with a tests/netlab_p2p.py agent: send {"op": ..., ...}, wait for its {"re": op} reply."""
        self.send(json.dumps({"op": op, **kwargs}))
        m = self.expect(r'^\{"re": "' + re.escape(op) + '"', reply_timeout)
        return json.loads(m.string)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def kill(self, grace: float = KILL_GRACE) -> None:
        """SIGTERM the process group, SIGKILL it after `grace` s; idempotent."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (a forked DHT child, p2pd): make sure none of it survives.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self._log.close()


@dataclass(eq=False)  # identity semantics: labs are tracked in a set
class NetLab:
    """A private emulated internet; see the module docstring. Every resource it makes, `close` removes."""
    workdir: Optional[Path] = None
    lab_id: str = field(default_factory=lambda: _free_lab_id())
    nodes: dict[str, Node] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)
    _procs: list[NsProcess] = field(default_factory=list)
    _n_public_ips: int = 0
    _n_homes: int = 0
    _n_links: int = 0
    _closed: bool = False
    _own_workdir: bool = False

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"netlab-{self.lab_id}-"))
            self._own_workdir = True
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prefix = f"nl{self.lab_id}"
        reap_stale_labs()
        OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        (OWNERS_DIR / self.prefix).write_text(f"{os.getpid()}\n")
        _live_labs.add(self)
        try:
            self.hub = self._add_ns("hub")
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- topology

    def _add_ns(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)  # recorded before configuring, so a half-built namespace is still deleted
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # p2pd's control socket is unix, but loopback tcp too
        return ns

    def _uplink(self, ns: str, dev: str, ip: str) -> Link:
        """A veth from `ns` (device `dev`, address `ip`/24 on the public net) to the hub's bridge."""
        self._n_links += 1
        hub_dev = f"v{self.lab_id}{self._n_links:02d}"  # unique within the hub; <= 15 chars
        # Both ends are created directly inside their namespaces: nothing ever appears in the root namespace.
        _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", hub_dev, "netns", self.hub])
        _run(["ip", "-n", self.hub, "link", "set", hub_dev, "master", "br0"])
        _run(["ip", "-n", self.hub, "link", "set", hub_dev, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        return Link(ns=ns, dev=dev, hub_dev=hub_dev)

    def _next_public_ip(self) -> str:
        self._n_public_ips += 1
        if self._n_public_ips > 250:
            raise NetLabError("public net is full")
        return f"{PUBLIC_NET}.{self._n_public_ips}"

    def add_public(self, name: str, up_mbit: Optional[float] = None, down_mbit: Optional[float] = None) -> Node:
        """A node on the public net, dialable by every other node; optional rate limits on its link."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists")
        ns = self._add_ns(name)
        ip = self._next_public_ip()
        node = Node(name=name, ns=ns, ip=ip, kind="public", link=self._uplink(ns, "eth0", ip))
        self.nodes[name] = node
        self.set_rate(node, up_mbit, down_mbit)
        logger.debug(f"netlab {self.lab_id}: public {name} = {ip} ({ns})")
        return node

    def add_home(self, name: str, up_mbit: Optional[float] = None, down_mbit: Optional[float] = None) -> Node:
        """A node behind its own NAT router (masquerade; unsolicited inbound dropped); rates on the router's WAN."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists")
        self._n_homes += 1
        lan = f"10.213.{HOME_NET_BASE + self._n_homes}"
        router = self._add_ns(f"{name}-rt")
        ns = self._add_ns(name)
        wan_ip = self._next_public_ip()
        link = self._uplink(router, "wan0", wan_ip)
        _run(["ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
        _run(["ip", "-n", router, "link", "set", "lan0", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{lan}.2/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        # The home's only way out is its router; the router itself has no default route, so nothing leaves the lab.
        _run(["ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1"])
        _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        # A home NAT: LAN -> WAN masqueraded; from the WAN only replies to connections the home opened get in
        # (conntrack established/related); anything new from the WAN, forwarded or addressed to the router, drops.
        ruleset = f"""
table ip netlab_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" ip saddr {lan}.0/24 masquerade
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }}
}}
"""
        _run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=ruleset)
        node = Node(name=name, ns=ns, ip=f"{lan}.2", kind="home", link=link, router_ns=router, wan_ip=wan_ip)
        self.nodes[name] = node
        self.set_rate(node, up_mbit, down_mbit)
        logger.debug(f"netlab {self.lab_id}: home {name} = {lan}.2 behind {wan_ip} ({ns} via {router})")
        return node

    # ---------------------------------------------------------------- link control

    @staticmethod
    def _tbf(ns: str, dev: str, mbit: Optional[float]) -> None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # back to the default qdisc
        if mbit is None:
            return
        # burst: >= 10 ms of traffic and >= one 64 KiB GSO super-packet (veth offloads hand tbf big skbs);
        # latency bounds the queue (~100 ms of backlog, like a modest home-router buffer).
        burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.01))
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
              "burst", str(burst), "latency", "100ms"])

    def set_rate(self, node: Node | str, up_mbit: Optional[float] = None,
                 down_mbit: Optional[float] = None) -> None:
        """Rate-limit a node's access link (Mbit/s; None = unlimited). `down_mbit` defaults to `up_mbit`.

        tbf shapes egress only, so upload is shaped on the node-side veth end and download on the hub-side end."""
        node = self._node(node)
        if down_mbit is None:
            down_mbit = up_mbit
        self._tbf(node.link.ns, node.link.dev, up_mbit)
        self._tbf(self.hub, node.link.hub_dev, down_mbit)
        node.link.up_mbit, node.link.down_mbit = up_mbit, down_mbit

    def link_down(self, node: Node | str) -> None:
        """Cut a node off the public net (its hub-side veth end goes down; its own config stays intact)."""
        node = self._node(node)
        _run(["ip", "-n", self.hub, "link", "set", node.link.hub_dev, "down"])

    def link_up(self, node: Node | str) -> None:
        node = self._node(node)
        _run(["ip", "-n", self.hub, "link", "set", node.link.hub_dev, "up"])
        self._tbf(self.hub, node.link.hub_dev, node.link.down_mbit)  # a qdisc survives down/up; re-assert anyway

    @contextmanager
    def partitioned(self, node: Node | str) -> Iterator[None]:
        """`with lab.partitioned(node): time.sleep(60)` — the link is back up afterwards, even on error."""
        self.link_down(node)
        try:
            yield
        finally:
            if not self._closed:
                self.link_up(node)

    def link_stats(self, node: Node | str) -> dict[str, int]:
        """Bytes sent/received on the node's access link (from the node side), for bandwidth accounting."""
        node = self._node(node)
        out = _run(["ip", "-n", node.link.ns, "-j", "-s", "link", "show", "dev", node.link.dev]).stdout
        st = json.loads(out)[0]["stats64"]
        return {"tx_bytes": int(st["tx"]["bytes"]), "rx_bytes": int(st["rx"]["bytes"])}

    def _node(self, node: Node | str) -> Node:
        return self.nodes[node] if isinstance(node, str) else node

    # ---------------------------------------------------------------- processes

    def popen(self, node: Node | str, argv: Sequence[str], *, name: Optional[str] = None,
              env: Optional[dict] = None, stdin: bool = False) -> NsProcess:
        """Start `argv` inside the node's namespace (its stderr goes to a log file under `workdir`)."""
        node = self._node(node)
        if self._closed:
            raise NetLabError("lab is closed")
        name = name or f"{node.name}-{len(self._procs)}"
        run_env = dict(os.environ if env is None else env)
        # Let `python -m tests.netlab_p2p` and `-m peer.run` resolve from the repo wherever the caller's cwd is.
        run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), run_env.get("PYTHONPATH")) if p)
        proc = NsProcess(argv, node.ns, self.workdir / f"{name}.log", env=run_env, stdin=stdin)
        self._procs.append(proc)
        return proc

    def python(self, node: Node | str, *args: str, **kwargs) -> NsProcess:
        """`python *args` inside the node (e.g. ``lab.python(n, "-m", "tests.netlab_p2p", ...)``)."""
        return self.popen(node, [sys.executable, *args], **kwargs)

    def p2p_agent(self, node: Node | str, p2p_kwargs: Optional[dict] = None, daemon_args: Optional[dict] = None,
                  *, timeout: float = 30.0, name: Optional[str] = None) -> NsProcess:
        """Start a tests/netlab_p2p.py hivemind.P2P agent in the node; returns once it printed its `ready` line.

        The returned process has `.ready` = {"peer_id", "maddrs", "t_since_start"}; talk to it with `.request`."""
        node = self._node(node)
        argv = ["-m", "tests.netlab_p2p", "--host", node.ip, "--kwargs", json.dumps(p2p_kwargs or {}),
                "--daemon-args", json.dumps(daemon_args or {})]
        proc = self.python(node, *argv, name=name, stdin=True)
        proc.ready = json.loads(proc.expect(r'^\{"re": "ready"', timeout).string)
        return proc

    def run(self, node: Node | str, argv: Sequence[str], timeout: float = CMD_TIMEOUT,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command inside the node's namespace and wait for it (capped by `timeout`)."""
        return _run(["ip", "netns", "exec", self._node(node).ns, *argv], timeout=timeout, check=check)

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Kill every process started in the lab, then delete its namespaces (and thereby all veths/qdiscs/nft)."""
        if self._closed:
            return
        self._closed = True
        _live_labs.discard(self)
        for proc in self._procs:
            try:
                proc.kill()
            except Exception as e:  # keep tearing down: one stuck process must not leak the namespaces
                logger.warning(f"netlab {self.lab_id}: killing {proc.argv[:3]} failed: {e!r}")
        for ns in reversed(self._namespaces):
            # Anything still inside one of *our* namespaces (a daemon that left its process group) dies too,
            # otherwise the namespace would outlive `ip netns del` as long as the process does.
            _delete_namespace(ns)
        self._namespaces.clear()
        (OWNERS_DIR / self.prefix).unlink(missing_ok=True)
        if self._own_workdir and os.environ.get("NETLAB_KEEP_LOGS") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_leftover_labs() -> None:
    """Last resort for a lab whose owner crashed before `close` (KeyboardInterrupt mid-setup, a forgotten lab)."""
    for lab in list(_live_labs):
        lab.close()


try:
    import pytest
except ImportError:  # the harness is also used by bench scripts that need not have pytest
    pytest = None

if pytest is not None:
    @pytest.fixture
    def netlab(tmp_path: Path) -> Iterator[NetLab]:
        """A fresh `NetLab` per test (logs under the test's tmp_path), torn down afterwards; skips without root."""
        reason = netlab_unavailable()
        if reason:
            pytest.skip(reason)
        with NetLab(workdir=tmp_path / "netlab") as lab:
            yield lab
