"""`python -m peer.plot`: a run dir's curves in one PNG, several runs overlaid.

    python -m peer.plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--x step|tokens|time]

Four panels from the files every peer writes: training loss and held-out loss (`eval_loss`) from metrics.jsonl,
tokens/s from metrics.jsonl, and the wall time of each applied sync round from rounds.jsonl (a peer without
sync has none). Each run is one colour, labelled by its run dir. Needs matplotlib (`pip install -e ".[plot]"`);
a missing or unreadable run dir is one line on stderr and exit 2. Nothing else is read or written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from peer.cli import OneLineParser

PROG = "python -m peer.plot"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Loss, held-out loss, tokens/s and round time of run dirs in one PNG.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs (each with metrics.jsonl)")
    p.add_argument("--out", default="runs.png", metavar="FILE.png", help="where the PNG goes (default: runs.png)")
    p.add_argument("--x", choices=("step", "tokens", "time"), default="step",
                   help="x axis: local step, tokens trained, or minutes since the run's first record (default: step)")
    return p


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a torn last line (a peer killed mid-write) is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def series(records: list[dict[str, Any]], field: str, x: str, t0: float) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have a numeric `field` (and the x field)."""
    xs, ys = [], []
    for r in records:
        value, at = r.get(field), r.get("time" if x == "time" else x)
        if isinstance(value, (int, float)) and isinstance(at, (int, float)):
            xs.append((at - t0) / 60 if x == "time" else at)
            ys.append(value)
    return xs, ys


def plot(run_dirs: list[Path], out: Path, x: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [(axes[0][0], "loss", "training loss"), (axes[0][1], "eval_loss", "held-out loss"),
              (axes[1][0], "tokens_per_s", "tokens/s"), (axes[1][1], "seconds", "round wall time (s)")]
    for run_dir in run_dirs:
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        rounds_path = run_dir / "rounds.jsonl"
        rounds = read_jsonl(rounds_path) if rounds_path.exists() else []
        t0 = min((r["time"] for r in metrics + rounds if isinstance(r.get("time"), (int, float))), default=0.0)
        label = run_dir.name
        for ax, field, _ in panels:
            xs, ys = series(rounds if field == "seconds" else metrics, field, x, t0)
            if xs:
                ax.plot(xs, ys, marker="o" if field in ("eval_loss", "seconds") else None, markersize=3,
                        label=label)
    x_label = {"step": "local step", "tokens": "tokens", "time": "minutes"}[x]
    for ax, _, title in panels:
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dirs = [Path(d) for d in args.run_dirs]
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            print(f"{PROG}: error: {run_dir} has no metrics.jsonl (is it a run dir?)", file=sys.stderr)
            return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: needs matplotlib: pip install -e \".[plot]\"", file=sys.stderr)
        return 2
    try:
        plot(run_dirs, Path(args.out), args.x)
    except OSError as e:
        print(f"{PROG}: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(run_dirs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
