"""Peak memory and time of one SPES training step: a peer owning 1/4 of the experts vs one owning all of them.

    python -m bench.memory                      # paper-1b shape (vocab 32000, batch 1 x 512 tokens), 3 arms
    python -m bench.memory --shape tiny         # seconds: smoke run of the same code
    python -m bench.memory --arm owned_quarter  # one arm in this process (what the driver runs per arm)
    python -m bench.memory --peer-run           # whole-process peak RSS of `peer.run --max-steps 1`, all vs 1/4
    python -m bench.memory --peer-run --repeat 3  # the same, each arm 3 times (interleaved): median and range

The model and optimizer are built as `peer.train.Trainer` builds them (then `release_freed_memory`). One step = the
project's `model.model.lm_loss` forward, backward, grad clipping, the project's AdamW (`peer.optim.build_optimizer`)
step and `zero_grad(set_to_none=True)`, like `peer.train.Trainer.train_step` with grad_accum 1, on CPU in fp32
(frozen experts stored in `model.frozen_expert_dtype`, bf16 by default).
Each arm runs in its own fresh subprocess, one after the other, so no arm sees another's memory.

Memory is the process's resident set (RSS), read from the kernel: "peak RSS" is the exact high-water mark of
the whole process (what `getrusage().ru_maxrss` reports), "before step" is the RSS once model and optimizer are
built (AdamW state is created lazily, during the first step). Phase peaks (forward / backward / optimizer)
come from resetting the kernel's high-water mark between phases (see bench/common.py). Step 1 is a warm-up
(and allocates AdamW state; autograd's saved tensors are audited during it); the next `--timed-steps` steps
are timed (median). By default routing is made balanced (every expert gets the same number of tokens, as in
steady-state training), because a freshly initialized router sends most tokens of deep layers to a few experts:
the others would get no gradient and no AdamW state, and the measured step would be cheaper than a real one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F

from bench.common import (GIB, MIB, PeakMeter, config_path, format_table, get_logger, OtherCpu, rss_bytes,
                          set_threads, setup_logging, wait_until_quiet)

if TYPE_CHECKING:
    from model.model import SpesMoE
    from peer.config import RunConfig, TrainConfig

logger = get_logger(__name__)

RESULT_PREFIX = "BENCH_RESULT "
# arm -> (which experts are owned, frozen_expert_dtype override or None for the config's value)
ARMS: dict[str, tuple[str, str | None]] = {
    "all_owned": ("all", None),
    "owned_quarter": ("quarter", None),
    "quarter_fp32_frozen": ("quarter", "float32"),
    # Diagnostic, not run by default: frozen experts through plain F.linear(x, w.float()), i.e. without
    # model.experts._FrozenLinear, to show what that custom autograd function saves.
    "quarter_naive_upcast": ("quarter", None),
    # model.expert_kernel=grouped (issue 11): what the grouped GEMM's stacked weights cost at the peak.
    "quarter_grouped": ("quarter", None),
    "all_grouped": ("all", None),
}
DEFAULT_ARMS = ["all_owned", "owned_quarter", "quarter_fp32_frozen"]
# Shape defaults: paper-1b with a 32k vocabulary and 512-token sequences (the setting).
SHAPE_DEFAULTS = {"paper-1b": {"vocab_size": 32000, "seq_len": 512}}


def build_config(shape: str, vocab: int | None, seq_len: int | None, frozen_dtype: str | None) -> "RunConfig":
    """The RunConfig of `shape` with the bench's model overrides applied."""
    from peer.config import load_config

    model: dict[str, Any] = dict(SHAPE_DEFAULTS.get(shape, {}))
    if vocab:
        model["vocab_size"] = vocab
    if seq_len:
        model["seq_len"] = seq_len
    if frozen_dtype:
        model["frozen_expert_dtype"] = frozen_dtype
    return load_config(config_path(shape), overrides=[{"model": model, "train": {"grad_accum": 1}}])


def owned_experts(kind: str, num_experts: int) -> list[int]:
    """'all' -> every expert; 'quarter' -> experts 0 .. num_experts/4 - 1 (at least one)."""
    return list(range(num_experts)) if kind == "all" else list(range(max(1, num_experts // 4)))


def _balanced_router_forward(self: torch.nn.Module,
                             hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3MoeTopKRouter.forward with the top-k choice replaced by round-robin: token t goes to experts
    (t*k .. t*k+k-1) mod E, so every expert gets the same number of tokens. The routing weights are still the
    router's softmax probabilities of those experts (gradients reach the router as usual)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    num_tokens = probs.shape[0]
    slots = torch.arange(num_tokens, device=probs.device)[:, None] * self.top_k + torch.arange(self.top_k, device=probs.device)
    indices = slots % self.num_experts
    top_value = probs.gather(1, indices)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), indices


def balance_routing(model: "SpesMoE") -> None:
    """Make every layer's router send the same number of tokens to each expert (see _balanced_router_forward)."""
    for layer in model.lm.model.layers:
        layer.mlp.gate.forward = types.MethodType(_balanced_router_forward, layer.mlp.gate)


def _naive_frozen_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype))


class SavedTensorAudit:
    """Counts what autograd saves for backward during a forward pass (unique storages, model weights excluded)
    and spots fp32 copies of frozen expert weights among them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_ptrs = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.frozen_keys: set[tuple] = set()
        for name, buf in model.named_buffers():
            if ".mlp.experts." in name and buf.dtype != torch.float32:
                self.frozen_keys.add(self._key(buf))
        self.storages: dict[int, int] = {}
        self.upcast_copies: dict[int, int] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        # Storage-level identity (element count + first values in memory order), so a transposed view of an
        # upcast copy (what mm saves for `x @ w.T`) matches the contiguous frozen buffer it came from.
        numel = t.untyped_storage().nbytes() // t.element_size()
        head = t.detach().as_strided((min(4, numel),), (1,), 0)
        return numel, tuple(head.float().tolist())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.model_ptrs and ptr not in self.storages:
            self.storages[ptr] = storage.nbytes()
            if t.dtype == torch.float32 and self._key(t) in self.frozen_keys:
                self.upcast_copies[ptr] = storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_step(model: "SpesMoE", optimizer: torch.optim.Optimizer, batch: torch.Tensor, tcfg: "TrainConfig",
             meter: PeakMeter,
             audit: "SavedTensorAudit | None" = None) -> dict[str, Any]:
    """One training step as in Trainer.train_step (grad_accum 1); returns phase peaks, sizes and times."""
    from model.model import lm_loss

    out: dict[str, Any] = {}
    start = time.perf_counter()
    model.train()
    meter.start()
    t0 = time.perf_counter()
    if audit is not None:
        with torch.autograd.graph.saved_tensors_hooks(audit.pack, audit.unpack):
            loss, parts = lm_loss(model, batch, tcfg.z_loss, tcfg.lb_loss)
    else:
        loss, parts = lm_loss(model, batch, tcfg.z_loss, tcfg.lb_loss)
    out["forward_s"] = time.perf_counter() - t0
    out["forward_peak"] = meter.stop()
    out["after_forward_rss"] = rss_bytes()

    meter.start()
    t0 = time.perf_counter()
    loss.backward()
    del loss
    out["backward_s"] = time.perf_counter() - t0
    out["backward_peak"] = meter.stop()
    out["after_backward_rss"] = rss_bytes()
    out["grad_bytes"] = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)

    meter.start()
    t0 = time.perf_counter()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if tcfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out["optimizer_s"] = time.perf_counter() - t0
    out["optimizer_peak"] = meter.stop()
    out["step_s"] = time.perf_counter() - start
    out["after_step_rss"] = rss_bytes()
    out["adam_state_bytes"] = _tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                                            if torch.is_tensor(v))
    out["ce"] = parts["ce"]
    return out


def run_arm(arm: str, shape: str, vocab: int | None, seq_len: int | None, batch_size: int,
            threads: int, timed_steps: int, routing: str) -> dict[str, Any]:
    """Build the model for `arm`, run 1 warm-up + `timed_steps` steps, return every measurement."""
    from model.model import SpesMoE
    from peer.optim import build_optimizer
    from peer.train import release_freed_memory

    threads = set_threads(threads)
    meter = PeakMeter()
    rss_runtime = rss_bytes()  # torch + transformers + hivemind imported, nothing built
    owned_kind, frozen_dtype = ARMS[arm]
    cfg = build_config(shape, vocab, seq_len, frozen_dtype)
    mcfg = cfg.model
    mcfg.expert_kernel = "grouped" if arm.endswith("_grouped") else "loop"
    owned = owned_experts(owned_kind, mcfg.num_experts)
    if arm == "quarter_naive_upcast":
        import model.experts as experts_module

        experts_module.frozen_linear = _naive_frozen_linear  # ExpertSlot.forward looks it up at call time

    meter.start()
    t0 = time.perf_counter()
    model = SpesMoE(mcfg, owned_experts=owned, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train)
    release_freed_memory()  # as peer.train.Trainer does once it has built them
    build_s = time.perf_counter() - t0
    build_peak = meter.stop()
    if routing == "balanced":
        balance_routing(model)
    rss_before = rss_bytes()

    shared = _tensor_bytes(p for _, p in model.shared_parameters())
    trainable_bytes = _tensor_bytes(p for p in model.parameters() if p.requires_grad)
    frozen = _tensor_bytes(b for n, b in model.named_buffers() if ".mlp.experts." in n)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, mcfg.vocab_size, (batch_size, mcfg.seq_len + 1), generator=gen)

    logger.info(f"[{arm}] {shape}: owned {len(owned)}/{mcfg.num_experts} experts, frozen {mcfg.frozen_expert_dtype}, "
                f"{model.num_parameters('trainable') / 1e6:.1f}M trainable of {model.num_parameters('total') / 1e6:.1f}M; "
                f"built in {build_s:.1f}s, RSS {rss_before / GIB:.2f} GiB; threads {threads}")
    audit = SavedTensorAudit(model)
    steps = [run_step(model, optimizer, batch, cfg.train, meter, audit=audit)]
    logger.info(f"[{arm}] warm-up step {steps[0]['step_s']:.2f}s, peak {max(steps[0][k] for k in ('forward_peak', 'backward_peak', 'optimizer_peak')) / GIB:.2f} GiB")
    for i in range(timed_steps):
        steps.append(run_step(model, optimizer, batch, cfg.train, meter))
        logger.info(f"[{arm}] step {i + 2}: {steps[-1]['step_s']:.2f}s")
    timed = steps[1:]
    step_s = sorted(s["step_s"] for s in timed)[len(timed) // 2]
    experts_with_grad = sum(1 for n, p in model.named_parameters() if ".mlp.experts." in n and n.endswith("down_proj")
                            and p in optimizer.state)
    return {
        "arm": arm, "shape": shape, "owned": owned, "num_experts": mcfg.num_experts,
        "frozen_dtype": mcfg.frozen_expert_dtype, "vocab_size": mcfg.vocab_size, "seq_len": mcfg.seq_len,
        "batch_size": batch_size, "threads": threads, "meter": meter.method, "routing": routing,
        "owned_expert_slots": len(owned) * mcfg.n_layers, "owned_expert_slots_trained": experts_with_grad,
        "params_total": model.num_parameters("total"), "params_trainable": model.num_parameters("trainable"),
        "bytes_shared_params": shared, "bytes_owned_expert_params": trainable_bytes - shared,
        "bytes_frozen_experts": frozen, "rss_runtime": rss_runtime, "build_peak": build_peak, "build_s": build_s,
        "rss_before_step": rss_before, "peak_rss": meter.process_peak,
        "step_peak": max(s[k] for s in steps for k in ("forward_peak", "backward_peak", "optimizer_peak")),
        "saved_activation_bytes": audit.saved_bytes, "saved_upcast_copies": len(audit.upcast_copies),
        "saved_upcast_bytes": sum(audit.upcast_copies.values()),
        "step_s": step_s, "steps": steps,
    }


def run_arm_subprocess(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one arm in a fresh `python -m bench.memory --arm ARM` and return its result."""
    cmd = [sys.executable, "-m", "bench.memory", "--arm", arm, "--shape", args.shape, "--batch", str(args.batch),
           "--threads", str(args.threads), "--timed-steps", str(args.timed_steps), "--routing", args.routing]
    if args.vocab:
        cmd += ["--vocab", str(args.vocab)]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.wait_quiet:
        wait_until_quiet(args.wait_quiet)
    logger.info(f"running {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    other = OtherCpu().start()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(config_path(args.shape).parent.parent))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"arm {arm} failed with exit code {proc.returncode}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"arm {arm} printed no result")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["wall_s"] = wall
    result["other_cpu"] = other.stop()
    return result


# --peer-run arms: the experts `peer.run --experts` is given.
PEER_RUN_ARMS = {"all_owned": "all", "owned_quarter": "quarter"}


def run_peer_process(arm: str, args: argparse.Namespace, run_dir: str, identity: str) -> dict[str, Any]:
    """One `python -m peer.run --max-steps 1` (a lone peer: DHT, data, model, one step, the sync state it keeps
    for its rounds); returns the whole process's peak RSS (`ru_maxrss` of the child, exact). Every run gets the
    same `identity` file, so every run trains on the same first batch (a peer's data order derives from its peer
    ID, and the experts that batch reaches are the ones that get AdamW state)."""
    cfg = build_config(args.shape, args.vocab or None, args.seq_len or None, None)
    owned = owned_experts(PEER_RUN_ARMS[arm], cfg.model.num_experts)
    cmd = [sys.executable, "-m", "peer.run", "--config", str(config_path(args.shape)), "--tokenizer", "builtin",
           "--max-steps", "1", "--experts", ",".join(map(str, owned)), "--run-dir", run_dir,
           "--identity-path", identity,
           "--set", f"model.vocab_size={cfg.model.vocab_size}", "--set", f"model.seq_len={cfg.model.seq_len}",
           "--set", f"train.batch_size={args.batch}", "--set", "train.grad_accum=1",
           "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0"]
    if args.wait_quiet:
        wait_until_quiet(args.wait_quiet)
    logger.info(f"running {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "peer.log"), "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(config_path(args.shape).parent.parent))
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, not by Popen: its rusage is the child's own
        code = os.waitstatus_to_exitcode(status)
        log.seek(0)
        if code != 0:
            raise RuntimeError(f"peer.run ({arm}) failed with exit code {code}: {log.read()[-300:]}")
    return {"arm": arm, "owned": len(owned), "num_experts": cfg.model.num_experts,
            "wall_s": time.perf_counter() - t0, "peak_rss": usage.ru_maxrss * 1024}


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _mib(x: float) -> str:
    return f"{x / MIB:,.0f}"


def report(results: list[dict[str, Any]]) -> str:
    """The result tables (main comparison, per-phase peaks, where the memory goes)."""
    base = next((r for r in results if r["arm"] == "all_owned"), results[0])
    first = results[0]
    lines = [f"bench.memory: shape {first['shape']} (vocab {first['vocab_size']}, batch {first['batch_size']} x "
             f"{first['seq_len']} tokens), CPU fp32, {first['threads']} threads, {first['routing']} routing; "
             f"peak = {first['meter']}", ""]
    rows = []
    for r in results:
        owned = (f"{len(r['owned'])}/{r['num_experts']} ({r['owned_expert_slots_trained']}/"
                 f"{r['owned_expert_slots']} updated)")
        rows.append([r["arm"], owned, r["frozen_dtype"] if len(r["owned"]) < r["num_experts"] else "-",
                     f"{r['params_total'] / 1e6:.1f}M", f"{r['params_trainable'] / 1e6:.1f}M",
                     _gib(r["rss_before_step"]), _gib(r["peak_rss"]), f"{r['step_s']:.2f}",
                     f"{r['peak_rss'] / base['peak_rss']:.3f}", f"{r['step_s'] / base['step_s']:.3f}"])
    lines.append(format_table(["arm", "owned experts (layer slots with AdamW state)", "frozen dtype", "params total", "trainable params",
                               "RSS before step GiB", "peak RSS GiB", "step s", "mem ratio vs all", "time ratio vs all"],
                              rows))
    lines += ["", "Per phase of the timed step (peak RSS GiB; seconds):", ""]
    rows = []
    for r in results:
        s = r["steps"][-1]
        rows.append([r["arm"], _gib(s["forward_peak"]), _gib(s["backward_peak"]), _gib(s["optimizer_peak"]),
                     f"{s['forward_s']:.2f}", f"{s['backward_s']:.2f}", f"{s['optimizer_s']:.2f}",
                     f"{r['build_s']:.1f}", f"{r.get('wall_s', float('nan')):.1f}",
                     f"{r.get('other_cpu', float('nan')):.0%}"])
    lines.append(format_table(["arm", "fwd peak", "bwd peak", "optim peak", "fwd s", "bwd s", "optim s",
                               "build s", "process wall s",
                               "CPU used by other processes"], rows))
    lines += ["", "Where the peak goes (MiB, tensor sizes counted exactly). At the peak (end of backward or the "
              "optimizer step) these tensors are live; 'rest' = peak - live: transients plus freed memory "
              "(activations, temporaries) that malloc keeps mapped. Saved activations are what autograd keeps for "
              "backward during the forward pass (freed by the optimizer step):", ""]
    rows = []
    for r in results:
        s = r["steps"][-1]
        live = {
            "runtime": r["rss_runtime"], "shared fp32": r["bytes_shared_params"],
            "owned experts fp32": r["bytes_owned_expert_params"], "frozen experts": r["bytes_frozen_experts"],
            "grads": s["grad_bytes"], "AdamW state": s["adam_state_bytes"],
        }
        total = sum(live.values())
        rows.append([r["arm"]] + [_mib(v) for v in live.values()] + [
            _mib(total), _mib(r["peak_rss"]), _mib(r["peak_rss"] - total), _mib(r["saved_activation_bytes"]),
            f"{r['saved_upcast_copies']} ({_mib(r['saved_upcast_bytes'])})"])
    lines.append(format_table(["arm", "runtime (imports)", "shared fp32", "owned experts fp32", "frozen experts",
                               "grads", "AdamW state", "= live", "peak", "rest", "saved activations",
                               "fp32 frozen-expert copies saved"], rows))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="paper-1b", choices=["paper-1b", "small", "tiny"],
                        help="model shape: a config in configs/ (default paper-1b)")
    parser.add_argument("--arm", choices=sorted(ARMS), help="run only this arm, in this process (prints one "
                        f"'{RESULT_PREFIX.strip()} {{json}}' line); default: every arm, each in a subprocess")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=DEFAULT_ARMS,
                        help=f"arms the driver runs, in order (default: {' '.join(DEFAULT_ARMS)})")
    parser.add_argument("--vocab", type=int, default=0, help="override model.vocab_size (paper-1b default 32000)")
    parser.add_argument("--seq-len", type=int, default=0, help="override model.seq_len (paper-1b default 512)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: one per CPU core)")
    parser.add_argument("--timed-steps", type=int, default=3, help="steps timed after the warm-up (median; default 3)")
    parser.add_argument("--routing", choices=["balanced", "natural"], default="balanced",
                        help="balanced (default): every expert gets the same number of tokens, as in steady-state "
                             "training with the load-balance loss; natural: the freshly initialized router decides "
                             "(at init it sends most tokens of deep layers to a few experts, so unused experts get "
                             "no gradient and no AdamW state and the step's memory is understated)")
    parser.add_argument("--wait-quiet", type=float, default=300, metavar="SECONDS",
                        help="before each arm, wait up to this long for other processes to leave the CPUs idle "
                             "(0: don't wait; default 300)")
    parser.add_argument("--peer-run", action="store_true",
                        help="instead of the arms: whole-process peak RSS of `python -m peer.run --max-steps 1` "
                             "owning all experts vs a quarter (a lone peer with its DHT, data and sync state)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="--peer-run: run the arms N times, interleaved, and report medians and ranges (the "
                             "all-owned peer's peak varies by ~1 GiB from run to run; default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write all results as JSON to FILE")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    return args


def peer_run_table(runs: list[dict[str, Any]]) -> str:
    """One row per arm: median and range of its peak RSS over the repeats, and the median of the per-repeat
    ratios (each quarter run against the all-owned run of the same repeat)."""
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in PEER_RUN_ARMS}
    base = by_arm["all_owned"]
    rows = []
    for arm, arm_runs in by_arm.items():
        rss = [r["peak_rss"] for r in arm_runs]
        ratios = [r["peak_rss"] / b["peak_rss"] for r, b in zip(arm_runs, base)]
        rows.append([arm, f"{arm_runs[0]['owned']}/{arm_runs[0]['num_experts']}", _gib(statistics.median(rss)),
                     f"{_gib(min(rss))}-{_gib(max(rss))}", f"{statistics.median(ratios):.3f}",
                     ", ".join(f"{x:.3f}" for x in ratios),
                     f"{statistics.median(r['wall_s'] for r in arm_runs):.1f}"])
    return format_table(["arm", "owned experts", "peak RSS GiB", "range GiB", "mem ratio vs all",
                         "ratio per repeat", "process wall s"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.arm:
        result = run_arm(args.arm, args.shape, args.vocab or None, args.seq_len or None, args.batch, args.threads,
                         args.timed_steps, args.routing)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    t0 = time.perf_counter()
    if args.peer_run:
        with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
            identity = os.path.join(tmp, "peer.key")
            runs = [run_peer_process(arm, args, tempfile.mkdtemp(dir=tmp), identity)
                    for _ in range(args.repeat) for arm in PEER_RUN_ARMS]
        print(f"bench.memory --peer-run: shape {args.shape}, `python -m peer.run --max-steps 1`, "
              f"whole-process peak RSS, {args.repeat} run(s) per arm\n")
        print(peer_run_table(runs))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs, f, indent=1)
        return 0
    results = [run_arm_subprocess(arm, args) for arm in args.arms]
    print(report(results))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
