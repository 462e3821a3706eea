"""`python -m peer.run`: train one peer (SPEC §3). With no arguments: the default small model on the built-in
corpus, on CPU or GPU, with no network access.

Exit codes: 0 on a clean finish (max steps reached, or Ctrl-C/SIGTERM handled after finishing the step and
writing a checkpoint); 2 with a one-line message naming the cause for bad input.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import logging

from hivemind.utils.logging import get_logger, use_hivemind_log_handler

from peer.config import ConfigError, load_config, parse_override

logger = get_logger(__name__)

# Flags of features this build does not contain yet (Prometheus metrics come with the operations work).
UNAVAILABLE_FLAGS = ("metrics_port",)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m peer.run", description="Train one SPES peer (Mixture-of-Experts, sparse expert sync).")
    p.add_argument("--config", metavar="FILE", help="YAML run config; flags override it (default: built-in small config)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of peers of an existing swarm to join")
    p.add_argument("--run-id", help="run name; namespaces every DHT key and the default run dir (config: run_id)")
    p.add_argument("--experts", help="experts to own: auto (least covered), all, or a list like 0-3,8 (config: sync.experts)")
    p.add_argument("--max-steps", type=int, metavar="N", help="stop after N local optimizer steps (config: train.max_steps)")
    p.add_argument("--sync-every", type=int, metavar="H", help="sync every H local steps, 0 = never (config: sync.every)")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics and checkpoints go (default: runs/RUN_ID)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port (0 = off)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="multiaddrs to listen on for the swarm")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="public multiaddrs to announce to other peers")
    p.add_argument("--identity-path", metavar="FILE", help="private key file for a stable peer ID")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to train (config: train.device)")
    p.add_argument("--dataset", metavar="NAME_OR_PATH",
                   help="hub dataset name, local path (txt/jsonl/parquet), or builtin (config: data.dataset)")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="HF tokenizer name/path or builtin (config: data.tokenizer)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field by dotted path, e.g. --set model.d_model=512 (repeatable)")
    return p


def overrides_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Flags as config overrides, applied after the config file; --set items last."""
    flat = {
        "run_id": args.run_id, "run_dir": args.run_dir,
        "sync.experts": args.experts, "sync.every": args.sync_every,
        "train.max_steps": args.max_steps, "train.device": args.device,
        "data.dataset": args.dataset, "data.tokenizer": args.tokenizer,
    }
    overrides: list[dict[str, Any]] = []
    for key, value in flat.items():
        if value is not None:
            nested: dict[str, Any] = {}
            cursor = nested
            parts = key.split(".")
            for part in parts[:-1]:
                cursor = cursor.setdefault(part, {})
            cursor[parts[-1]] = value
            overrides.append(nested)
    overrides.extend(parse_override(item) for item in args.set)
    return overrides


def setup_logging() -> None:
    """One log format for hivemind, transformers and this project: hivemind's handler on the root logger."""
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        for name in UNAVAILABLE_FLAGS:
            if getattr(args, name) not in (None, 0):
                raise ConfigError(f"--{name.replace('_', '-')}: not available in this build yet")
        cfg = load_config(args.config, overrides_from_args(args))
        if cfg.sync.experts not in ("auto", "all"):
            from sync.config import parse_expert_list
            parse_expert_list(cfg.sync.experts, cfg.model.num_experts)
        # Heavy imports after argument checks so bad flags fail fast.
        from model.checkpoint import CheckpointError
        from peer.node import PeerNode
        from peer.train import StopOnSignal
        from sync.swarm import SwarmError
        if args.initial_peers and cfg.sync.every == 0:
            raise ConfigError("--initial-peers needs synchronization on (sync.every > 0)")
        try:
            node = PeerNode(cfg, initial_peers=args.initial_peers or (),
                            host_maddrs=args.host_maddrs or ("/ip4/0.0.0.0/tcp/0",),
                            announce_maddrs=args.announce_maddrs or (), identity_path=args.identity_path)
        except (CheckpointError, SwarmError) as e:
            raise ConfigError(str(e)) from None
        with node, StopOnSignal(node.trainer):
            node.run()
    except (ConfigError, ValueError, FloatingPointError) as e:
        logger.error(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        logger.error("aborted by a second interrupt; the newest checkpoint on disk is still complete")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
