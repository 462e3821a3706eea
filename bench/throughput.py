"""Training throughput of the project's loop vs a plain PyTorch loop over stock transformers Qwen3-MoE.

    python -m bench.throughput                  # configs/small.yaml shape: d 256, 4 layers, 8 experts, 8 x 256 tokens
    python -m bench.throughput --shape tiny --rounds 3 --steps 3     # smoke run
    python -m bench.throughput --profile        # also print where each arm's time goes (torch.profiler)

Arms, all in this one process and on the same data stream (`peer.data.build_data` of the config):
- `ours_all`: `peer.train.Trainer(cfg).train_step()` with `sync.experts = "all"` (DiLoCo/centralized peer);
- `stock`: transformers' `Qwen3MoeForCausalLM(hf_config(cfg.model))` with its default experts implementation,
  holding the same initial weights (`model.export.to_hf_model`), trained by a plain loop: forward, the same
  loss math as ours (CE + z_loss*z + lb_loss*load-balance, via `model.model.router_losses`; `--stock-loss hf`
  uses `out.loss` from `labels=` with transformers' own load-balance term instead), backward, grad clipping,
  `torch.optim.AdamW` with the same lr schedule/betas/weight decay and the same decay/no-decay groups;
- `ours_quarter`: the Trainer owning the first quarter of the experts (what a SPES peer runs per step);
- with `--grouped`, `ours_all_grouped` / `ours_quarter_grouped`: the same with `model.expert_kernel=grouped`
  (one grouped GEMM over the owned and one over the frozen experts instead of one matmul per expert).

Arms are interleaved (round r runs `--steps` steps of every arm, order alternating between rounds) after a
warm-up, and the median tokens/s over rounds is reported with its ratio to `stock`; the thread count is fixed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from bench.common import (OtherCpu, config_path, format_table, get_logger, median, set_threads, setup_logging,
                          wait_until_quiet)

if TYPE_CHECKING:
    from peer.config import RunConfig
    from peer.train import Trainer

logger = get_logger(__name__)


def make_config(shape: str, experts: str, run_dir: Path, overrides: list[dict[str, Any]]) -> "RunConfig":
    """The shape's RunConfig for a bench Trainer: no checkpoints, evals or logs, CPU, the given experts."""
    from peer.config import load_config

    base = {"run_dir": str(run_dir),
            "train": {"checkpoint_every": 0, "eval_every": 0, "log_every": 0, "device": "cpu"},
            "sync": {"experts": experts}}
    return load_config(config_path(shape), overrides=[base] + overrides)


class StockLoop:
    """A plain PyTorch training loop over stock `Qwen3MoeForCausalLM` (the baseline)."""

    def __init__(self, cfg: "RunConfig", init_from: torch.nn.Module, loss_kind: str) -> None:
        from model.export import to_hf_model
        from peer.data import build_data
        from peer.tokenizer import build_tokenizer

        self.cfg = cfg
        self.loss_kind = loss_kind
        tcfg = cfg.train
        self.model = to_hf_model(init_from).train()  # stock class, stock config, same weights as ours
        self.model.config.router_aux_loss_coef = tcfg.lb_loss
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2))
        from peer.optim import lr_at

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_at(step, tcfg) / tcfg.lr)
        self.data = build_data(cfg.data, build_tokenizer(cfg.data.tokenizer), cfg.model.seq_len, tcfg.seed)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        from model.model import router_losses

        tcfg = self.cfg.train
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.loss_kind == "hf":
            # transformers' own loss: shifted CE over inputs + router_aux_loss_coef * its load-balance loss
            return self.model(input_ids=inputs, labels=inputs, output_router_logits=True, use_cache=False).loss
        out = self.model.model(input_ids=inputs, output_router_logits=True, use_cache=False)
        logits = self.model.lm_head(out.last_hidden_state)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1))
        z, lb = router_losses(tuple(out.router_logits), self.cfg.model.top_k)
        return ce + tcfg.z_loss * z + tcfg.lb_loss * lb

    def train_step(self) -> float:
        batch = self.data.train.next_batch(self.cfg.train.batch_size)
        loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def check_same_model(trainer: "Trainer", stock: StockLoop) -> tuple[float, float]:
    """Loss of ours and of the stock model on one held-out batch before training (must agree)."""
    from model.model import lm_loss

    batch = trainer.data.eval_blocks[: trainer.cfg.train.batch_size]
    tcfg = trainer.cfg.train
    with torch.no_grad():
        ours, _ = lm_loss(trainer.model, batch, tcfg.z_loss, tcfg.lb_loss)
        theirs = stock.loss(batch)
    return float(ours), float(theirs)


def profile_arm(name: str, step: Callable[[], Any], steps: int, rows: int) -> str:
    """torch.profiler table of `steps` steps of one arm, top `rows` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48)
    return f"== profile: {name}, {steps} steps ==\n{table}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="small", choices=["paper-1b", "small", "tiny"],
                        help="model/batch shape: a config in configs/ (default small)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved measuring rounds (default 7)")
    parser.add_argument("--steps", type=int, default=5, help="steps per arm per round (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: one per CPU core)")
    parser.add_argument("--stock-loss", choices=["same", "hf"], default="same",
                        help="stock arm's loss: 'same' math as ours (default) or transformers' out.loss")
    parser.add_argument("--no-quarter", action="store_true", help="skip the ours_quarter arm")
    parser.add_argument("--grouped", action="store_true",
                        help="also run ours_all and ours_quarter with model.expert_kernel=grouped")
    parser.add_argument("--profile", action="store_true", help="profile ours_all and stock afterwards")
    parser.add_argument("--wait-quiet", type=float, default=300, metavar="SECONDS",
                        help="before measuring, wait up to this long for other processes to leave the CPUs idle "
                             "(0: don't wait; default 300)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every arm, e.g. --set train.batch_size=4 (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    from peer.config import parse_override
    from peer.train import Trainer

    threads = set_threads(args.threads)
    overrides = [parse_override(item) for item in args.set]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spes-bench-") as tmp:
        cfg_all = make_config(args.shape, "all", Path(tmp) / "all", overrides)
        quarter = max(1, cfg_all.model.num_experts // 4)
        ours_all = Trainer(cfg_all)
        stock = StockLoop(cfg_all, ours_all.model, args.stock_loss)
        arms: dict[str, Callable[[], Any]] = {"ours_all": ours_all.train_step, "stock": stock.train_step}
        if not args.no_quarter:
            spec = "0" if quarter == 1 else f"0-{quarter - 1}"
            ours_quarter = Trainer(make_config(args.shape, spec, Path(tmp) / "quarter", overrides))
            arms["ours_quarter"] = ours_quarter.train_step
        if args.grouped:
            grouped = [parse_override("model.expert_kernel=grouped")]
            arms["ours_all_grouped"] = Trainer(make_config(args.shape, "all", Path(tmp) / "allg",
                                                           overrides + grouped)).train_step
            if not args.no_quarter:
                arms["ours_quarter_grouped"] = Trainer(make_config(args.shape, spec, Path(tmp) / "quarterg",
                                                                   overrides + grouped)).train_step
        loss_ours, loss_stock = check_same_model(ours_all, stock)
        impl = stock.model.config._experts_implementation
        attn = stock.model.config._attn_implementation
        logger.info(f"initial eval-batch loss: ours {loss_ours:.6f}, stock {loss_stock:.6f} "
                    f"(stock experts_implementation={impl}, attention={attn})")

        mcfg, tcfg = cfg_all.model, cfg_all.train
        tokens_per_step = tcfg.batch_size * tcfg.grad_accum * mcfg.seq_len
        for name, step in arms.items():
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step()
            logger.info(f"warm-up {name}: {(time.perf_counter() - t0) / max(args.warmup, 1):.3f}s/step")
        if args.wait_quiet:
            wait_until_quiet(args.wait_quiet)
        rates: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        other = OtherCpu().start()
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    arms[name]()
                rates[name].append(args.steps * tokens_per_step / (time.perf_counter() - t0))
            logger.info(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {rates[n][-1]:,.0f} tok/s" for n in names))

        other_share = other.stop()
        base = median(rates["stock"])
        rows = []
        for name in names:
            med = median(rates[name])
            rows.append([name, f"{med:,.0f}", f"{min(rates[name]):,.0f} .. {max(rates[name]):,.0f}",
                         f"{tokens_per_step / med * 1000:.0f}", f"{med / base:.3f}"])
        print(f"bench.throughput: shape {args.shape} (d {mcfg.d_model}, {mcfg.n_layers} layers, {mcfg.num_experts} "
              f"experts top-{mcfg.top_k}, expert hidden {mcfg.expert_hidden}, vocab {mcfg.vocab_size}), batch "
              f"{tcfg.batch_size} x {mcfg.seq_len} tokens, CPU fp32, {threads} threads; {args.rounds} interleaved "
              f"rounds x {args.steps} steps after {args.warmup} warm-up steps per arm; CPU used by other processes "
              f"while measuring: {other_share:.0%}")
        print(f"stock = transformers {type(stock.model).__name__} (experts_implementation={impl}, "
              f"attention={attn}), loss '{args.stock_loss}'; ours_quarter owns {quarter}/{mcfg.num_experts} experts")
        print(f"initial loss on one eval batch: ours {loss_ours:.6f}, stock {loss_stock:.6f}")
        print()
        print(format_table(["arm", "tokens/s (median)", "min .. max over rounds", "ms/step", "ratio vs stock"], rows))
        print(f"\nours_all / stock = {median(rates['ours_all']) / base:.3f} (goal >= 0.97)")
        if args.profile:
            for name in ("ours_all", "stock"):
                print()
                print(profile_arm(name, arms[name], args.steps, 25))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
