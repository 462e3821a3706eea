"""Run configuration: one dataclass per part, composed into `RunConfig`, loaded from YAML plus dotted overrides.

Unknown keys and values of the wrong type are errors (`ConfigError`) naming the dotted key, so a typo in a
config file or a `--set` flag never silently trains with a default.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model.config import ModelConfig
from sync.config import SyncConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


@dataclass
class TrainConfig:
    """Local optimization (AdamW, cosine with warm-up, z-loss and load-balance loss; docs/DESIGN.md, "The method")."""

    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 20
    max_steps: int = 200
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    z_loss: float = 0.001
    lb_loss: float = 0.01
    # Decayed load-balance loss (docs/DESIGN.md, "The method"): own experts' counts scaled 0.7 -> 1.0 over the first 20 % of steps.
    decayed_lb: bool = False
    # Own-expert routing bias (docs/DESIGN.md, "Levers beyond the paper"): while training, this is added to the
    # router logits of the experts this peer owns when choosing a token's top-k experts (weights unbiased), so
    # more of its tokens reach experts it can train; it decays linearly to 0 over the first
    # `own_expert_bias_decay` of max_steps, so the router ends the run choosing as it does at eval. 0 = off.
    own_expert_bias: float = 0.0
    own_expert_bias_decay: float = 1.0
    device: str = "auto"
    # Recompute each decoder layer in backward: activations stop growing with seq_len x batch (costs ~1 forward).
    gradient_checkpointing: bool = False
    # Start a new run from these weights instead of the seed's init: a folder written by `python -m model.upcycle`
    # (its init.safetensors). Ignored when the run dir already has a checkpoint (resuming wins). "" = off.
    init_from: str = ""

    def validate(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
        for name in ("warmup_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "weight_decay", "grad_clip", "z_loss", "lb_loss"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not math.isfinite(self.own_expert_bias) or self.own_expert_bias < 0:
            raise ConfigError(f"train.own_expert_bias must be a finite number >= 0, got {self.own_expert_bias}")
        if not 0 < self.own_expert_bias_decay <= 1:
            raise ConfigError(f"train.own_expert_bias_decay must be in (0, 1], got {self.own_expert_bias_decay}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device must be auto|cpu|cuda, got {self.device!r}")


@dataclass
class DataConfig:
    """Where text comes from. "builtin" = the corpus the project builds locally from CPython's documentation."""

    dataset: str = "builtin"
    tokenizer: str = "builtin"
    text_field: str = "text"
    # Hub split to read; local files are all read and split here.
    split: str = "train"
    # Hub names stream by default, local paths do not; true/false forces it.
    streaming: bool | None = None
    # Share of documents held out for eval_loss (the same documents on every peer).
    eval_fraction: float = 0.02
    # This peer's shard of the training documents (the swarm sets these per peer).
    shard_index: int = 0
    num_shards: int = 1

    def validate(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.num_shards <= 0 or not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(f"data.shard_index must be in [0, data.num_shards), got {self.shard_index}/{self.num_shards}")


@dataclass
class MetricsConfig:
    """Prometheus endpoint; port 0 = off."""

    port: int = 0
    host: str = ""
    """Address the endpoint listens on; "" = as the peer does (the first --host-maddrs address: loopback for a
    peer that listens on loopback only, every interface for one that listens on 0.0.0.0)."""


@dataclass
class AdmissionConfig:
    """Closed runs (docs/DESIGN.md, "Closed runs"). With no organizer key the run is open: anyone may join."""

    organizer_key: str = ""
    """The organizer's Ed25519 public key (base64, as `python -m peer.admit keygen` prints it) or a file holding
    it. Set = a closed run: only peers with an unexpired, unrevoked ticket for their own peer ID take part."""
    ticket: str = ""
    """This peer's ticket from the organizer (`python -m peer.admit sign`): a file, or its base64 text. Needs
    --identity-path: the ticket is signed for that identity's peer ID."""


@dataclass
class NetworkConfig:
    """How this peer takes part when it cannot accept connections (docs/DESIGN.md, "Peers behind NAT"; sync/reach.py). Both off: a public
    peer that others dial directly."""

    use_auto_relay: bool = False
    """Behind NAT: reserve a slot on the initial peers as libp2p circuit relays, so that every peer can reach
    this one by its peer ID; bulk data goes over connections this peer opens itself (--use-auto-relay)."""
    client_mode: bool = False
    """Behind NAT: run the DHT as a hivemind client, which only makes requests (--client-mode)."""
    join_timeout_s: float = 20.0
    """How long to keep trying the initial peers at start before exiting with "cannot reach any initial peer": a
    home line's first connection can fail, a bootstrap node may be restarting (0 = one attempt)."""


@dataclass
class RunConfig:
    """Everything one peer needs; the YAML file mirrors this structure (configs/*.yaml)."""

    run_id: str = "spes-demo"
    run_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def validate(self) -> None:
        if not self.run_id or any(c in self.run_id for c in " ./\\"):
            raise ConfigError(f"run_id must be non-empty without spaces, dots or slashes, got {self.run_id!r}")
        try:
            self.model.validate()
            self.sync.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.train.validate()
        self.data.validate()
        if not 0 <= self.metrics.port < 65536:
            raise ConfigError(f"metrics.port must be in [0, 65535], got {self.metrics.port}")
        if not 0 <= self.network.join_timeout_s <= 3600:
            raise ConfigError(f"network.join_timeout_s must be in [0, 3600] (0 = one attempt), "
                              f"got {self.network.join_timeout_s}")

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.run_id

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert a YAML value to a dataclass field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"bad value for {key}: {value!r} is not {tp}")
    if origin is typing.Literal:  # a choice among named values (torchtitan's style): name them in the error
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"bad value for {key}: {value!r} is not one of {', '.join(map(repr, choices))}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise ConfigError(f"unsupported field type for {key}: {tp}")
    raise ConfigError(f"bad value for {key}: expected {tp.__name__}, got {value!r}")


def _apply(obj: Any, updates: dict[str, Any], prefix: str) -> None:
    """Recursively set fields of dataclass `obj` from a nested dict, rejecting unknown keys."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}'")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"bad value for {dotted}: expected a mapping of its fields, got {value!r}")
            _apply(current, value, dotted + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted))


def parse_override(item: str) -> dict[str, Any]:
    """Turn "a.b=value" into {"a": {"b": parsed_value}}; the value is parsed as YAML (so 1e-3, true, null work)."""
    if "=" not in item:
        raise ConfigError(f"bad --set {item!r}: expected KEY=VALUE")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad --set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    nested: dict[str, Any] = {}
    cursor = nested
    parts = key.split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return nested


def load_config(path: str | Path | None = None, overrides: list[dict[str, Any]] | None = None) -> RunConfig:
    """Build a RunConfig: defaults <- YAML file <- each override dict in order; then validate."""
    cfg = RunConfig()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must be a mapping at top level")
        _apply(cfg, data, "")
    for override in overrides or []:
        _apply(cfg, override, "")
    cfg.validate()
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the run dir's config.yaml)."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def eval_block_count(train: TrainConfig) -> int:
    """How many held-out blocks make the run's eval set: the first train.eval_batches x train.batch_size of them.
    One definition for the training loop's eval_loss and `python -m peer.eval` (both score exactly these)."""
    return train.batch_size * train.eval_batches


# The settings every peer of a run must share (sync/settings.py): the model (but how this machine runs its
# experts), the tokenizer, and what decides a round's aggregate or bounds a peer's weight. A joiner whose
# values differ exits naming the first one.
_SHARED_SYNC = ("every", "compression", "sparse.chunk", "sparse.topk", "sparse.bits", "outer", "outer_lr",
                "outer_momentum", "max_peer_processes", "max_delta_ratio", "contributors",
                "roster_shard")
_LOCAL_MODEL = {"expert_kernel"}


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """{dotted config name: value} of the settings every peer of `cfg.run_id` must share."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items() if k not in _LOCAL_MODEL}
    out["data.tokenizer"] = cfg.data.tokenizer
    out["train.batch_size"], out["train.grad_accum"] = cfg.train.batch_size, cfg.train.grad_accum
    for name in _SHARED_SYNC:
        value: Any = cfg.sync
        for part in name.split("."):
            value = getattr(value, part)
        out[f"sync.{name}"] = value
    return out
