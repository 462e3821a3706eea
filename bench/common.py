"""Shared helpers of the bench scripts: model shapes, process memory readings, process census, medians and
plain-text tables.

Memory is read from Linux's /proc: `VmRSS` (resident now) and `VmHWM` (the kernel's exact resident high-water
mark, the number `getrusage().ru_maxrss` reports). Writing "5" to /proc/self/clear_refs resets the high-water
mark to the current RSS, which lets `PeakMeter` measure the exact peak of one phase (e.g. one backward pass)
without sampling. Where that file is not writable it falls back to a thread sampling VmRSS every 2 ms.
"""
from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Sequence

# (hivemind 1.1.12's package __init__ does not re-export get_logger: `from hivemind import get_logger` fails.)
from hivemind.utils.logging import get_logger

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "paper-1b": REPO_ROOT / "configs" / "paper-1b.yaml",
    "small": REPO_ROOT / "configs" / "small.yaml",
    "tiny": REPO_ROOT / "configs" / "tiny.yaml",
}
GIB = 1024 ** 3
MIB = 1024 ** 2

logger = get_logger(__name__)


def config_path(shape: str) -> Path:
    """The YAML config file of a named shape (`paper-1b`, `small`, `tiny`)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    return SHAPES[shape]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """Peak resident set size since the process started or since the last `PeakMeter` reset."""
    return _status_kib("VmHWM") * 1024


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMeter:
    """Exact peak RSS of consecutive phases: `start()` opens a phase, `stop()` returns its peak in bytes.

    The whole-process peak (what ru_maxrss would say had it never been reset) is kept in `process_peak`.
    """

    def __init__(self, sample_interval_s: float = 0.002) -> None:
        self.exact = _can_reset_hwm()
        self.process_peak = hwm_bytes() if self.exact else rss_bytes()
        self._interval = sample_interval_s
        self._sampled_peak = 0
        self._running = False
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while self._running:
            self._sampled_peak = max(self._sampled_peak, rss_bytes())
            time.sleep(self._interval)

    def start(self) -> None:
        if self.exact:
            self.process_peak = max(self.process_peak, hwm_bytes())
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._sampled_peak = rss_bytes()
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def stop(self) -> int:
        if self.exact:
            peak = hwm_bytes()
        else:
            self._running = False
            assert self._thread is not None
            self._thread.join()
            peak = max(self._sampled_peak, rss_bytes())
        self.process_peak = max(self.process_peak, peak)
        return peak

    @property
    def method(self) -> str:
        return "VmHWM reset per phase (exact)" if self.exact else "VmRSS sampled every 2 ms"


def setup_logging() -> None:
    """Show the bench's own log lines (hivemind's handler, on stderr: peer/logs.py); the result tables go to
    stdout."""
    from peer.logs import setup_logging as setup
    setup()


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its finished children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class OtherCpu:
    """Share of the machine's CPU capacity that *other* processes (not this one, not its children) used
    between `start()` and `stop()`: a noise indicator for timings on a shared machine (0.0 = quiet)."""

    def start(self) -> "OtherCpu":
        self._cpu0, self._own0, self._wall0 = _cpu_times(), _own_cpu_s(), time.monotonic()
        return self

    def stop(self) -> float:
        (total1, idle1), (total0, idle0) = _cpu_times(), self._cpu0
        busy_s = ((total1 - total0) - (idle1 - idle0)) / os.sysconf("SC_CLK_TCK")
        capacity = (time.monotonic() - self._wall0) * (os.cpu_count() or 1)
        return max(0.0, busy_s - (_own_cpu_s() - self._own0)) / max(capacity, 1e-9)


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle


def wait_until_quiet(timeout_s: float, busy_threshold: float = 0.15, window_s: float = 2.0) -> float:
    """Wait (up to timeout_s) until other processes leave the CPUs idle: machine-wide busy share over a
    `window_s` window below `busy_threshold`. Returns the last busy share measured (0..1)."""
    deadline = time.monotonic() + timeout_s
    busy = 1.0
    while True:
        total0, idle0 = _cpu_times()
        time.sleep(window_s)
        total1, idle1 = _cpu_times()
        busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
        if busy < busy_threshold:
            return busy
        if time.monotonic() >= deadline:
            logger.warning(f"the machine is still {busy:.0%} busy with other work after waiting {timeout_s:.0f}s: "
                           f"timings will be noisy")
            return busy
        logger.info(f"waiting for other work to finish: CPUs {busy:.0%} busy")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table with columns padded for reading in a terminal."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def set_threads(threads: int) -> int:
    """Fix torch's intra-op thread count (0 = one per CPU core); returns the count used."""
    import torch

    threads = threads or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


# ---- processes of this run (from /proc) ------------------------------------------------------------------------

def descendants(root: int) -> list[int]:
    """PIDs of every live descendant process of `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (0 for processes that exited meanwhile)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def process_name(pid: int) -> str:
    """The command name of a process ("?" if it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def pss_bytes(pids: Sequence[int]) -> int:
    """Sum of proportional set sizes (shared pages split between the processes mapping them)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def census() -> tuple[int, int, float]:
    """(descendant processes, of which p2pd, PSS of this process + descendants in GiB)."""
    kids = descendants(os.getpid())
    p2pd = sum(process_name(p) == "p2pd" for p in kids)
    return len(kids), p2pd, pss_bytes([os.getpid(), *kids]) / 2**30


def wait_for_no_p2pd(timeout_s: float = 20.0) -> int:
    """Wait until no p2pd daemon started by this process is left; returns how many remain."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in descendants(os.getpid()) if process_name(p) == "p2pd"]
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.5)
