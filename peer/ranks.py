"""One peer spanning several local processes: `torchrun --nproc-per-node K -m peer.run ...` (SPEC 3a).

The K processes are one swarm peer. Rank 0 (the *leader*) is the peer everyone else sees: it holds the run-dir
lock, joins the DHT, runs the rounds, writes config, metrics and checkpoints and serves Prometheus metrics. Ranks
1..K-1 (the *replicas*) hold the same model and optimizer, train on their own order of the data and never touch
the network or the run dir. Every step the trainable parameters' gradients are averaged over the K processes
before the optimizer step, so the K copies stay identical and the peer trains K × `train.batch_size` sequences
per step. Whatever the leader changes outside the optimizer (a round applied, experts adopted or given back, a
rollback, handed-over moments, a resumed checkpoint) reaches the replicas by broadcast. docs/DESIGN.md, "One peer
over several processes", says why it is built this way.

Why not DDP or FSDP2: a peer's trainable set changes at run time (ownership moves with rounds, and newly owned
experts are new parameter tensors), rounds overwrite parameters outside autograd, and an owned expert that no
token chose must keep a `None` gradient so AdamW leaves it alone (model/experts.py). A wrapper built over a fixed
parameter list would have to be rebuilt at every ownership change and would hand such experts zero gradients.
The price: the all-reduce runs after backward instead of overlapping it (one flat buffer per step).

Everything sent between the processes is raw tensors plus JSON headers encoded as uint8 tensors: nothing is
pickled. The collectives are issued in the same order on every rank by construction (`Trainer.run` calls the
hooks below at the same points on every rank, and every decision that changes that order is the leader's,
broadcast first).

Shape suffixes: `_U` the bytes of a JSON payload, `_X` one flat buffer (every trainable gradient, then the loss
parts), `_P` one entry per trainable parameter (then the two layout words).
"""
from __future__ import annotations

import datetime
import json
import os
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from hivemind.utils.logging import get_logger

if TYPE_CHECKING:
    from peer.train import Trainer

logger = get_logger(__name__)

# The leader may spend a round's worth of time in its post-step sync (a blocking round, a state download) while
# the replicas wait in the next collective: far longer than any healthy step, far shorter than "forever".
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class RankError(RuntimeError):
    """The processes of one peer disagree or one of them failed (the peer stops; the message names the cause)."""


def world_from_env() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) as torchrun sets them, or None for a plain one-process peer.

    Raises ValueError for a multi-machine launch: a peer is one machine (its replicas exchange full gradients
    every step); machines join the run as separate peers."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    if local_world != world:
        raise ValueError(f"torchrun started {world} processes on {world // max(local_world, 1)} machines: a peer "
                         f"spans one machine; start one peer per machine (each joins the run with --initial-peers)")
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world


class PeerRanks:
    """This process's place in a K-process peer, and the collectives that keep the K copies identical."""

    def __init__(self, rank: int, local_rank: int, world_size: int, device_kind: str):
        """Joins the process group (torchrun's env:// rendezvous). `device_kind`: "cuda" puts each process on
        GPU `local_rank` with NCCL for tensors (gloo still carries the small CPU control messages), else gloo."""
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        if device_kind == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            backend = "cpu:gloo,cuda:nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend, timeout=_COLLECTIVE_TIMEOUT)
        self.stop_agreed = False  # the stop every rank acts on (a signal may reach one rank only)
        self.readback = True  # whether the next step reads its loss back (the leader's needs_readback)
        self._signature: tuple | None = None  # the leader's state as last sent (see _state_signature)
        self.started = False  # the leader sent its start message (after that, failures are collective)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rank_data_seed(self, seed: int) -> int:
        """Rank r's data order: the peer's own seed on rank 0 (a one-process peer reads the same order), a
        different one derived from it on every other rank."""
        if self.rank == 0:
            return seed
        return (seed * 1_000_003 + self.rank * 7_919) % (2 ** 32)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- JSON over the control channel (CPU tensors: gloo) ------------------------------------------------

    def broadcast_json(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (JSON: no pickle)."""
        if self.leader:
            payload_U = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
            size = torch.tensor([payload_U.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        if not self.leader:
            payload_U = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload_U, src=0)
        return json.loads(payload_U.numpy().tobytes().decode())

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        payload_U = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([payload_U.numel()], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        padded_U = torch.zeros(longest, dtype=torch.uint8)
        padded_U[:payload_U.numel()] = payload_U
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(parts, padded_U)
        return [json.loads(p[:int(s)].numpy().tobytes().decode()) for p, s in zip(parts, sizes)]

    def _all_max(self, *flags: int) -> list[int]:
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t]

    # ---- start ------------------------------------------------------------------------------------------

    def start(self, message: dict[str, Any] | None = None) -> dict[str, Any]:
        """The leader's start message on every rank: {"error": ...} when the leader could not start (the replicas
        then exit with it), else {"data_seed", "data_states": [one per rank or None]}."""
        self.started = True
        return self.broadcast_json(message if self.leader else None)

    def all_ready(self, ok: bool) -> bool:
        """Whether every rank built its trainer (a replica that failed has logged why)."""
        return self._all_max(0 if ok else 1)[0] == 0

    # ---- every step ---------------------------------------------------------------------------------------

    def average_gradients(self, params: list[torch.Tensor], parts: dict[str, Any]) -> dict[str, Any]:
        """Mean of every trainable parameter's gradient and of the loss parts over the K processes, in place.

        Two all-reduces per step: one flat buffer on the device (the gradients, then the loss parts) and one of
        presence flags on the CPU (whether a rank has a gradient is known on the host, so no GPU sync is needed to
        learn it). A parameter keeps `grad is None` only if it has none on every rank (an owned expert no token
        chose anywhere: AdamW must leave it alone, as on one process); one with a gradient somewhere gets the mean
        with zeros from the ranks where it had none, exactly what one process with the K batches would compute.
        Loss parts may be floats (read back) or 0-dim device tensors (deferred: nothing waits for the GPU here)."""
        keys = sorted(parts)
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        # `params` must come in the same order on every rank (the model's, not the optimizer's: ownership changes
        # append to the optimizer's groups in the order they happened). The layout's hash rides along, as h and
        # -h under MAX, so every rank learns whether all agree and none sums another's slice into its own.
        layout = zlib.crc32(json.dumps(sizes).encode()) & 0x3FFFFFFF
        present_P = torch.tensor([p.grad is not None for p in params] + [layout, -layout], dtype=torch.int32)
        dist.all_reduce(present_P, op=dist.ReduceOp.MAX)
        if int(present_P[-2]) != -int(present_P[-1]):
            raise RankError("the processes of this peer hold different trainable parameters (a missed ownership "
                            "change)")
        flat_X = torch.zeros(total + len(keys), dtype=torch.float32, device=self.device)
        offset = 0
        for p, n in zip(params, sizes):
            if p.grad is not None:
                flat_X[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        for j, key in enumerate(keys):
            flat_X[total + j] = parts[key]
        dist.all_reduce(flat_X)
        flat_X /= self.world_size
        offset = 0
        for p, n, has in zip(params, sizes, present_P[:len(params)].tolist()):
            if has:
                grad = flat_X[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = grad.clone()
                else:
                    p.grad.copy_(grad)
            offset += n
        tail_X = flat_X[total:]
        read = tail_X.tolist() if all(isinstance(parts[k], float) for k in keys) else None
        return {key: (read[j] if read is not None else tail_X[j].clone()) for j, key in enumerate(keys)}

    def mark_stepped(self, trainer: "Trainer") -> None:
        """Right after the optimizer step (before any callback): the leader's state as the replicas now have it
        too (the same step on the same averaged gradients)."""
        if self.leader:
            self._signature = _state_signature(trainer)

    def after_step(self, trainer: "Trainer") -> None:
        """After the callbacks of a step: agree on stopping and on the next step's readback, and send the
        leader's state if a callback changed it (a round applied, ownership moved)."""
        changed = self.leader and _state_signature(trainer) != self._signature
        readback = self.leader and trainer.needs_readback()
        stop, changed, readback = self._all_max(int(trainer.stopped), int(changed), int(readback))
        self.readback = bool(readback)
        if changed:
            self.sync_state(trainer)
        if stop and not self.stop_agreed:
            self.stop_agreed = True
            if not trainer.stopped:
                trainer.request_stop()  # the leader's callbacks hear of a stop that reached another rank only

    def after_nonfinite(self, trainer: "Trainer", restored: bool) -> bool:
        """A non-finite loss (the same on every rank: it is averaged): whether the leader's callbacks restored
        a good state; if so every rank now holds it."""
        restored = bool(self._all_max(int(self.leader and restored))[0])
        if restored:
            self.sync_state(trainer)
        return restored

    def after_train(self, trainer: "Trainer", final_checkpoint: bool) -> bool:
        """After the leader's post_train (the last round drained): its state and its decision to write a final
        checkpoint, on every rank."""
        changed = self.leader and _state_signature(trainer) != self._signature
        changed, final = self._all_max(int(changed), int(self.leader and final_checkpoint))
        if changed:
            self.sync_state(trainer)
        return bool(final)

    # ---- state ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync_state(self, trainer: "Trainer", initial: bool = False) -> None:
        """The leader's model, AdamW state, ownership and counters onto every rank (the replicas' are replaced).

        Model tensors are received in place; optimizer state is rebuilt from the leader's (a JSON header names
        every tensor with its shape and dtype first, so a replica allocates exactly what comes). `initial`: at
        start, where a replica also takes the leader's step (a resumed peer)."""
        from model.checkpoint import model_state_for_checkpoint
        from peer.optim import load_optimizer_state_tensors, optimizer_state_tensors
        if self.leader:
            trainer.follow_ownership()
            model_state = model_state_for_checkpoint(trainer.model)
            optim_state = optimizer_state_tensors(trainer.optimizer, trainer.model)
            header = {"owned": sorted(trainer.model.owned_experts), "step": trainer.step, "tokens": trainer.tokens,
                      "rounds": trainer.rounds, "model": _describe(model_state), "optim": _describe(optim_state)}
            self.broadcast_json(header)
            for tensor in list(model_state.values()) + list(optim_state.values()):
                dist.broadcast(_on(tensor, self.device), src=0)
            self._signature = _state_signature(trainer)
            return
        header = self.broadcast_json()
        if initial:
            trainer.step = int(header["step"])
        elif header["step"] != trainer.step:
            raise RankError(f"rank {self.rank} is at step {trainer.step}, the leader at {header['step']}")
        trainer.set_owned_experts(header["owned"])
        live = model_state_for_checkpoint(trainer.model)
        if list(live) != [name for name, _, _ in header["model"]]:
            raise RankError(f"rank {self.rank}: the model's tensors differ from the leader's")
        for (name, shape, dtype), tensor in zip(header["model"], live.values()):
            if list(tensor.shape) != shape or str(tensor.dtype) != dtype:
                raise RankError(f"rank {self.rank}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the "
                                   f"leader's {tuple(shape)} {dtype}")
            if tensor.device == self.device:
                dist.broadcast(tensor, src=0)
            else:
                received = torch.empty_like(tensor, device=self.device)
                dist.broadcast(received, src=0)
                tensor.copy_(received)
        optim_state = {}
        for name, shape, dtype in header["optim"]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=self.device)
            dist.broadcast(tensor, src=0)
            optim_state[name] = tensor
        trainer.optimizer.state.clear()
        load_optimizer_state_tensors(trainer.optimizer, trainer.model, optim_state)
        trainer.tokens, trainer.rounds = int(header["tokens"]), int(header["rounds"])

    def check_identical(self, trainer: "Trainer") -> None:
        """At the end of a run: every rank's model is the leader's (per-tensor sums and sums of squares, compared
        exactly), else RankError naming the tensors that differ — the gradient averaging or a state broadcast
        missed something."""
        sums = {}
        with torch.no_grad():
            for name, tensor in trainer.model.state_dict().items():
                t = tensor.detach().double()
                sums[name] = [float(t.sum()), float((t * t).sum())]
        every = self.gather_json(sums)
        differ = sorted({name for other in every[1:] for name in sums if other.get(name) != every[0].get(name)})
        if differ:
            raise RankError(f"the {self.world_size} processes of this peer ended with different models: "
                            f"{len(differ)} tensor(s) differ, e.g. {', '.join(differ[:4])}")
        if self.leader:
            logger.info(f"[{trainer.log_prefix}] the {self.world_size} processes of this peer hold the same model")


def _describe(tensors: dict[str, torch.Tensor]) -> list[list]:
    return [[name, list(t.shape), str(t.dtype)] for name, t in tensors.items()]


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Optimizer step counts live on the CPU beside CUDA parameters (peer/optim.py); NCCL sends device tensors.
    return tensor if tensor.device == device else tensor.to(device)


def _state_signature(trainer: "Trainer") -> tuple:
    """Changes whenever anything writes into the model or optimizer state, or replaces one of its tensors:
    every in-place write bumps a tensor's version counter, and new tensors have new storage. Cheap (no data
    is read), so the leader checks it after every step's callbacks instead of trusting each of them to say."""
    model_part = tuple((t.data_ptr(), t._version) for t in trainer.model.parameters()) + \
        tuple((t.data_ptr(), t._version) for t in trainer.model.buffers())
    optim_part = tuple((id(p), key, v.data_ptr(), v._version) for p, state in trainer.optimizer.state.items()
                       for key, v in state.items() if torch.is_tensor(v))
    return model_part, optim_part, tuple(sorted(trainer.model.owned_experts))
