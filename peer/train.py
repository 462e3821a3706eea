"""One peer's training loop: data, model, AdamW over owned experts + shared layers, logs, eval, checkpoints.

The loop is single-peer here; synchronization plugs in as a stateful callback (peer/callbacks.py: events after
every optimizer step and at the end, state carried in this trainer's checkpoints) so `sync/` never runs a training
loop and this file never talks to the network.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from hivemind.utils.logging import get_logger

from model.checkpoint import (CheckpointError, checkpoint_path, load_model_state, load_newest_complete,
                              model_state_for_checkpoint, prune_checkpoints, save_checkpoint)
from model.model import SpesMoE, decayed_lb_scale, lm_loss
from model.upcycle import read_init
from peer.callbacks import Callback, CallbackStateError, join_callback_states, split_callback_state
from peer.config import RunConfig, eval_block_count, save_config
from peer.data import build_data
from peer.optim import (build_optimizer, load_optimizer_state_tensors, lr_at, optimizer_state_tensors,
                        own_expert_bias_at, sync_optimizer_params)
from peer.tokenizer import build_tokenizer
from sync.config import default_experts_per_peer, parse_expert_list

if TYPE_CHECKING:
    from peer.ranks import PeerRanks

logger = get_logger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    libc_name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(libc_name).malloc_trim if libc_name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_malloc_trim = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand the CPU allocator's freed pages back to the OS (glibc `malloc_trim`): once, after the model is built.

    The build's temporaries (every expert is drawn in fp32, frozen ones then stored in bf16) can stay mapped in
    malloc's heap, and the first optimizer step would allocate AdamW's state on top of them (bench.memory). Not per
    step: the next forward would fault the handed-back activation pages in again, which small models feel most.
    The model is built on the CPU whatever the device, so this holds for a GPU peer's host memory too."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def resolve_experts(spec: str, cfg: RunConfig) -> list[int]:
    """Experts to own from --experts without a swarm (sync.every: 0): `auto` takes every expert its budget
    (sync.max_experts_per_peer) allows, lowest indices first: nobody else trains the others (the default job
    trained 2 of 8 and exported 6 at their random init)."""
    num_experts = cfg.model.num_experts
    if spec == "auto":
        return list(range(cfg.sync.max_experts_per_peer or num_experts))
    return parse_expert_list(spec, num_experts)


def _check_trainer_state(meta: dict) -> None:
    """A checkpoint's trainer metadata is whole (KeyError/ValueError/TypeError otherwise): checked before the
    model is built from it, so a damaged newest checkpoint falls back to the previous one."""
    int(meta["step"]), int(meta["tokens"]), int(meta.get("rounds", 0))
    if not isinstance(meta["data"], dict):
        raise TypeError("data state is not an object")
    ranks = meta.get("data_ranks")
    if ranks is not None and not (isinstance(ranks, list) and all(isinstance(r, dict) for r in ranks)):
        raise TypeError("data_ranks is not a list of data states")
    owned = meta.get("owned_experts")
    if owned is not None and not all(isinstance(e, int) for e in owned):
        raise TypeError("owned_experts is not a list of ints")


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class NonFiniteLoss(ArithmeticError):
    """A step's loss was NaN/inf; nothing was updated."""

    def __init__(self, loss: float):
        super().__init__(f"non-finite loss {loss}")
        self.loss = loss


class Trainer:
    """Trains one peer's share of the model. Call `run()`; `request_stop()` ends it after the current step."""

    def __init__(self, cfg: RunConfig, data_seed: int | None = None,
                 choose_auto: Callable[[int], list[int]] | None = None, deferred_readback: bool | None = None,
                 ranks: "PeerRanks | None" = None):
        """`data_seed` orders this peer's data (default train.seed; the swarm derives one per peer);
        `choose_auto(count)` picks experts for `--experts auto` (the swarm asks the DHT); `deferred_readback`
        (default: on CUDA) reads the loss back on log/eval/checkpoint steps only (see `train_step`);
        `ranks`: this process is one of a peer's K torchrun processes (peer/ranks.py). On rank 0 it is the
        peer as usual; on the other ranks it reads and writes nothing in the run dir and gets its state, data
        position and ownership from rank 0 (`PeerRanks.sync_state`)."""
        self.cfg = cfg
        self.ranks = ranks
        self.leader = ranks is None or ranks.leader
        self.world_size = 1 if ranks is None else ranks.world_size
        self.device = ranks.device if ranks is not None else resolve_device(cfg.train.device)
        self.deferred_readback = self.device.type == "cuda" if deferred_readback is None else deferred_readback
        # Steps skipped on the device for a non-finite loss since the last readback (deferred mode only).
        self._skipped_T: torch.Tensor | None = None
        self.last_loss_step = 0  # the step last_loss was read at
        self.run_dir = cfg.resolved_run_dir()
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        if len(self.tokenizer) > cfg.model.vocab_size:
            raise ValueError(f"tokenizer {cfg.data.tokenizer!r} has {len(self.tokenizer)} tokens but "
                             f"model.vocab_size is {cfg.model.vocab_size}")
        newest = load_newest_complete(self.ckpt_dir, check=_check_trainer_state) if self.leader else None
        resume_from, ckpt_tensors, ckpt_meta = newest if newest is not None else (None, {}, {})
        # A resumed peer keeps its data order (and so continues its epoch exactly).
        self.data_seed = int(ckpt_meta.get("data_seed", data_seed if data_seed is not None else cfg.train.seed))
        self.data = build_data(cfg.data, self.tokenizer, cfg.model.seq_len, self.data_seed,
                               max_eval_blocks=eval_block_count(cfg.train))

        self.step = 0
        self.tokens = 0
        self.rounds = 0
        self._stop = False
        # Everything that hooks into the loop (the swarm's sync, metrics), in the order added (add_callback).
        self.callbacks: list[Callback] = []
        # The resumed checkpoint's callback states, kept to hand them over when callbacks are added (only these
        # tensors: the model's and optimizer's copies must not stay alive next to the live ones).
        self._resumed: tuple[dict[str, torch.Tensor], dict] | None = None
        if resume_from is not None:
            self._resumed = ({k: v for k, v in ckpt_tensors.items() if k.startswith("callbacks.")}, ckpt_meta)
        self._resumed_from = resume_from
        # The other ranks' data positions in the resumed checkpoint (a K-process peer; rank 0 hands them out).
        data_ranks = ckpt_meta.get("data_ranks")
        self.resumed_data_ranks = data_ranks if isinstance(data_ranks, list) else None
        # Log lines say which run and which peer they come from; PeerNode sets its short peer ID.
        self.log_prefix = f"{cfg.run_id} solo"
        self.last_loss: float | None = None  # cross-entropy of the latest step (for metrics)

        if cfg.sync.experts == "auto" and ckpt_meta.get("owned_experts") is not None:
            owned = list(ckpt_meta["owned_experts"])  # continuing a run keeps what it owned
        elif cfg.sync.experts == "auto" and choose_auto is not None:
            owned = choose_auto(default_experts_per_peer(cfg.sync, cfg.model.num_experts))
        else:
            owned = resolve_experts(cfg.sync.experts, cfg)
        self.model = SpesMoE(cfg.model, owned_experts=owned, seed=cfg.train.seed).to(self.device)
        self.expert_kernel = self.model.use_expert_kernel(self.device)
        if cfg.train.gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.optimizer = build_optimizer(self.model, cfg.train)
        release_freed_memory()
        # The ownership the optimizer's parameters follow: the swarm changes the model's (adoption, hand-back)
        # and the optimizer catches up before the next step (_follow_ownership).
        self._optimizer_owned = self.model.owned_experts
        if resume_from is not None:
            self._restore(resume_from, ckpt_tensors, ckpt_meta)
        elif cfg.train.init_from and self.leader:
            self._init_from(Path(cfg.train.init_from))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if not self.leader:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        # The run dir carries its tokenizer so `python -m model.export` needs nothing else.
        self.tokenizer.save_pretrained(str(self.run_dir / "tokenizer"))

    # ---- state ------------------------------------------------------------------------------------------

    def _restore(self, path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_model_state(self.model, tensors, str(path))
        try:
            load_optimizer_state_tensors(self.optimizer, self.model, tensors)
            self.data.train.load_state_dict(meta["data"])
            self.step, self.tokens, self.rounds = int(meta["step"]), int(meta["tokens"]), int(meta.get("rounds", 0))
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"corrupt checkpoint {path}: bad trainer state ({e})") from None
        logger.info(f"resumed from {path} at step {self.step} ({self.tokens} tokens)")

    def _init_from(self, init_dir: Path) -> None:
        # Every peer loads the same file whatever it owns, as every peer builds the same seeded init otherwise.
        tensors = read_init(init_dir, self.cfg.model)
        load_model_state(self.model, tensors, str(init_dir / "init.safetensors"))
        logger.info(f"initialized from {init_dir} (upcycled weights)")

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of this step (rank 0 of a K-process peer writes it, with every rank's data position;
        the other ranks only hand theirs over and return None)."""
        data_ranks = None
        if self.ranks is not None:
            data_ranks = self.ranks.gather_json(self.data.train.state_dict())
            if not self.leader:
                return None
        self.follow_ownership()
        path = checkpoint_path(self.ckpt_dir, self.step)
        tensors = model_state_for_checkpoint(self.model)
        tensors.update(optimizer_state_tensors(self.optimizer, self.model))
        callback_tensors, callback_meta = join_callback_states(self.callbacks)
        tensors.update(callback_tensors)
        meta = {"step": self.step, "tokens": self.tokens, "rounds": self.rounds,
                "owned_experts": sorted(self.model.owned_experts), "data": self.data.train.state_dict(),
                "data_seed": self.data_seed, "run_id": self.cfg.run_id, "callbacks": callback_meta}
        if data_ranks is not None:
            meta["data_ranks"] = data_ranks[1:]
        save_checkpoint(path, tensors, meta)
        prune_checkpoints(self.ckpt_dir, self.cfg.train.keep_checkpoints)
        logger.info(f"checkpoint written: {path}")
        return path

    def add_callback(self, callback: Callback) -> bool:
        """Hook `callback` into the loop (after those added before). On a resumed trainer, the state the
        checkpoint holds for a callback of its name is loaded into it first; returns True if it was. A malformed
        state is a warning, and the callback starts fresh: the model and optimizer are already restored, and a
        callback's state (the sync round, ownership history) is rebuilt from the swarm."""
        self.callbacks.append(callback)
        if self._resumed is None:
            return False
        try:
            state = split_callback_state(callback.name, *self._resumed)
            if state is None:
                return False
            callback.load_state_dict(*state)
            return True
        except (CallbackStateError, KeyError, ValueError, TypeError) as e:
            logger.warning(f"checkpoint {self._resumed_from}: the {callback.name} state is unusable ({e}); "
                           f"starting it fresh")
            return False
        finally:  # handed over (or refused): its tensors need not stay in memory (an outer optimizer's are big)
            prefix = f"callbacks.{callback.name}."
            tensors, meta = self._resumed
            self._resumed = ({k: v for k, v in tensors.items() if not k.startswith(prefix)}, meta)

    def set_owned_experts(self, experts: list[int]) -> None:
        """Change ownership at run time: experts move between trainable and frozen, optimizer follows."""
        self.model.set_owned_experts(experts)
        self.follow_ownership()

    def follow_ownership(self) -> None:
        """Give the optimizer the model's trainable parameters if ownership changed since it last looked (the
        sync callback changes the model's ownership; its new experts' parameters are new tensors)."""
        if self.model.owned_experts != self._optimizer_owned:
            sync_optimizer_params(self.optimizer, self.model)
            self._optimizer_owned = self.model.owned_experts

    @property
    def resumed(self) -> bool:
        """It continues from a checkpoint (which holds its optimizer state)."""
        return self._resumed_from is not None

    @property
    def stopped(self) -> bool:
        """A stop was requested (signal, or a callback): the run did not end by completing max_steps."""
        return self._stop

    def _stopping(self) -> bool:
        """Whether the loop ends after this step: a K-process peer's ranks act on the stop they agreed on (a
        signal may reach one of them only), one process on its own flag."""
        return self.ranks.stop_agreed if self.ranks is not None else self._stop

    def request_stop(self) -> None:
        """Stop after the current step (may run inside a signal handler: callbacks only set flags)."""
        self._stop = True
        for callback in self.callbacks:
            callback.on_stop_requested()

    # ---- steps ------------------------------------------------------------------------------------------

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def needs_readback(self) -> bool:
        """Whether the next step reads its loss back (always, unless deferred; then on log, eval and checkpoint
        steps, the last step, a stop, and when a callback asks: the step after a round was applied)."""
        if not self.deferred_readback:
            return True
        tcfg, nxt = self.cfg.train, self.step + 1
        if nxt == 1 or nxt >= tcfg.max_steps or self._stop:
            return True
        if any(every and nxt % every == 0 for every in (tcfg.log_every, tcfg.eval_every, tcfg.checkpoint_every)):
            return True
        return any(callback.needs_checked_step(self) for callback in self.callbacks)

    def train_step(self, readback: bool = True) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches; returns mean loss parts.

        `readback` (always on CPU): the parts are floats, and a non-finite loss raises NonFiniteLoss before
        anything is updated. Without it (deferred mode, a GPU): the parts stay 0-dim device tensors and nothing
        waits for the GPU; a non-finite loss or gradient norm makes fused AdamW skip the update on the device
        (`found_inf`: parameters, moments and step count untouched), counted and reported at the next readback.
        Its `ce` is then 0 and `counted` 0, so the loop's mean loss leaves it out."""
        tcfg = self.cfg.train
        self.follow_ownership()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, tcfg)
        self.model.train()
        totals: dict[str, float] = {}
        tokens_before = self.tokens
        count_scale_E = None
        if tcfg.decayed_lb:
            count_scale_E = decayed_lb_scale(self.step, tcfg.max_steps, self.model.owned_experts,
                                             self.cfg.model.num_experts).to(self.device)
        if tcfg.own_expert_bias:
            self.model.set_own_expert_bias(own_expert_bias_at(self.step, tcfg))
        for _ in range(tcfg.grad_accum):
            batch = self.data.train.next_batch(tcfg.batch_size).to(self.device, non_blocking=True)
            with self._autocast():
                loss, parts = lm_loss(self.model, batch, tcfg.z_loss, tcfg.lb_loss, count_scale_E, readback=readback)
            (loss / tcfg.grad_accum).backward()
            for key, value in parts.items():
                totals[key] = totals.get(key, 0.0) + value / tcfg.grad_accum
            # A K-process peer trains K such batches per micro-step (SPEC 3a: it counts all of them).
            self.tokens += batch.shape[0] * (batch.shape[1] - 1) * self.world_size
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.ranks is not None:
            # In the model's order, the same on every rank (the optimizer's follows this rank's ownership history;
            # the gradient norm's sum in another order differs in its last bits, and so would every update).
            params = [p for p in self.model.parameters() if p.requires_grad]
            # Before the finite check: the mean loss is the same on every rank, so they all skip or all step.
            totals = self.ranks.average_gradients(params, totals)
        if not readback:
            return self._step_on_device(totals, params)
        if self._skipped_T is not None:
            skipped, self._skipped_T = int(self._skipped_T), None
            if skipped:
                logger.warning(f"[{self.log_prefix}] {skipped} step(s) before step {self.step + 1} had a non-finite "
                               f"loss or gradient and were skipped (nothing updated)")
        if not math.isfinite(totals["ce"]):
            # Before optimizer.step: NaN gradients would poison the AdamW moments for good.
            self.optimizer.zero_grad(set_to_none=True)
            self.tokens = tokens_before
            raise NonFiniteLoss(totals["ce"])
        if tcfg.grad_clip > 0:
            totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return totals

    def _step_on_device(self, totals: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
        tcfg = self.cfg.train
        bad_T = ~torch.isfinite(totals["ce"])
        if tcfg.grad_clip > 0:
            totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            bad_T = bad_T | ~torch.isfinite(totals["grad_norm"])
        # Fused AdamW reads these as GradScaler leaves them: found_inf 1 skips the whole update on the device.
        self.optimizer.found_inf, self.optimizer.grad_scale = bad_T.float(), None
        try:
            self.optimizer.step()
        finally:
            self.optimizer.found_inf = None
        self.optimizer.zero_grad(set_to_none=True)
        self._skipped_T = bad_T.long() if self._skipped_T is None else self._skipped_T + bad_T.long()
        totals["counted"] = (~bad_T).float()
        totals["ce"] = torch.where(bad_T, torch.zeros_like(totals["ce"]), totals["ce"])
        self.step += 1
        return totals

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy on the held-out blocks (the same blocks on every peer)."""
        self.model.eval()
        blocks = self.data.eval_blocks
        bs = self.cfg.train.batch_size
        losses, weights = [], []
        for start in range(0, min(len(blocks), eval_block_count(self.cfg.train)), bs):
            batch = blocks[start:start + bs].to(self.device)
            with self._autocast():
                out = self.model(batch[:, :-1])
            ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].reshape(-1))
            losses.append(ce.item())
            weights.append(batch.shape[0])
        return sum(l * w for l, w in zip(losses, weights)) / sum(weights)

    # ---- loop -------------------------------------------------------------------------------------------

    def _write_metrics(self, record: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def run(self) -> None:
        tcfg = self.cfg.train
        if self.step >= tcfg.max_steps:
            logger.info(f"nothing to do: step {self.step} >= max_steps {tcfg.max_steps}")
            return
        if not self.leader:
            logger.info(f"[{self.log_prefix}] rank {self.ranks.rank} of {self.world_size}: a replica of rank 0's "
                        f"model on {self.device}, training on its own data order")
        else:
            logger.info(f"[{self.log_prefix}] training on {self.device}"
                        f"{f' x {self.world_size} processes' if self.world_size > 1 else ''}: "
                        f"{self.model.num_parameters('total') / 1e6:.2f}M params total, "
                        f"{self.model.num_parameters('trainable') / 1e6:.2f}M trainable, owned experts "
                        f"{sorted(self.model.owned_experts)} of {self.cfg.model.num_experts} ({self.expert_kernel} "
                        f"experts); run dir {self.run_dir}")
        window_loss, window_n = 0.0, 0
        window_start, window_tokens = time.perf_counter(), self.tokens
        loop_start, loop_start_step = window_start, self.step
        last_saved = self.step
        ranks = self.ranks
        while self.step < tcfg.max_steps and not self._stopping():
            readback = self.needs_readback() if ranks is None else ranks.readback
            try:
                parts = self.train_step(readback)
            except NonFiniteLoss as e:
                restored = any(callback.on_nonfinite(self, e.loss) for callback in self.callbacks)
                if ranks is not None:
                    restored = ranks.after_nonfinite(self, restored)
                if restored:
                    continue  # restored: retry this step from the restored values
                raise FloatingPointError(f"loss became {e.loss} at step {self.step + 1}") from None
            if ranks is not None:
                ranks.mark_stepped(self)
            if readback:
                self.last_loss, self.last_loss_step = parts["ce"], self.step
            for callback in self.callbacks:
                callback.post_step(self)
            if ranks is not None:
                ranks.after_step(self)
            if not self.leader:  # rank 0 logs, evaluates and writes metrics for the peer
                if tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0 and not (
                        self.step >= tcfg.max_steps or self._stopping()):
                    self.save_checkpoint()  # hands this rank's data position to rank 0
                continue
            # Device tensors in deferred steps (summed on the device), read at the next log step.
            window_loss = window_loss + parts["ce"]
            window_n = window_n + parts.get("counted", 1)
            record = None
            now = time.perf_counter()
            if tcfg.log_every and (self.step % tcfg.log_every == 0 or self.step == 1 or self.step == tcfg.max_steps):
                tok_s = (self.tokens - window_tokens) / max(now - window_start, 1e-9)
                steps_s = (self.step - loop_start_step) / max(now - loop_start, 1e-9)
                eta = (tcfg.max_steps - self.step) / steps_s if steps_s > 0 else float("inf")
                window_loss, window_n = float(window_loss), float(window_n)
                record = {"step": self.step, "loss": window_loss / max(window_n, 1), "tokens": self.tokens,
                          "tokens_per_s": tok_s, "rounds": self.rounds,
                          "owned_experts": sorted(self.model.owned_experts), "time": time.time(),
                          "lr": lr_at(self.step - 1, tcfg), "z_loss": parts["z_loss"], "lb_loss": parts["lb_loss"]}
                logger.info(f"[{self.log_prefix}] step {self.step}/{tcfg.max_steps} | loss {record['loss']:.4f} | "
                            f"{tok_s:,.0f} tok/s | eta {_fmt_duration(eta)}")
                window_loss, window_n, window_start, window_tokens = 0.0, 0, now, self.tokens
            if tcfg.eval_every and (self.step % tcfg.eval_every == 0 or self.step == tcfg.max_steps):
                eval_loss = self.evaluate()
                logger.info(f"[{self.log_prefix}] step {self.step} | eval_loss {eval_loss:.4f}")
                record = record or {"step": self.step, "loss": parts["ce"], "tokens": self.tokens,
                                    "tokens_per_s": 0.0, "rounds": self.rounds,
                                    "owned_experts": sorted(self.model.owned_experts), "time": time.time()}
                record["eval_loss"] = eval_loss
            if record is not None:
                for callback in self.callbacks:
                    record.update(callback.record_fields(self))
                self._write_metrics(record)
            ending = self.step >= tcfg.max_steps or self._stopping()
            # The last checkpoint is written below, after post_train: it applies the final sync round, which a
            # checkpoint of the last step written here would miss (two peers' final checkpoints then differed).
            if tcfg.checkpoint_every and self.step % tcfg.checkpoint_every == 0 and not ending:
                self.save_checkpoint()
                last_saved = self.step
        if self._stop:
            logger.info(f"[{self.log_prefix}] stop requested: finished step {self.step}")
        rounds_before = self.rounds
        for callback in self.callbacks:
            callback.post_train(self)
        final = bool(tcfg.checkpoint_every) and (last_saved != self.step or self.rounds != rounds_before)
        if ranks is not None:
            final = ranks.after_train(self, final)
        if final:
            self.save_checkpoint()
        if ranks is not None:
            ranks.check_identical(self)
