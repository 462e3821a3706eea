"""Training data: documents -> tokens -> fixed-length blocks, a held-out eval set, and a resumable train stream.

Every document is tokenized without special tokens, followed by the tokenizer's end-of-text id, concatenated and
cut into blocks of seq_len + 1 tokens (inputs = block[:-1], targets = block[1:]); a tail shorter than a block is
dropped, as in transformers' run_clm "group texts" (map-style: per batch of 1000 documents; streaming: at the end).

Which documents a peer may train on is decided per document by a stable hash of its text (blake2b, not Python's
salted hash()), never by the seed or the order of the data: a document is held out for evaluation if the hash
falls below `eval_fraction`, otherwise it belongs to training shard `hash % num_shards`. So every peer holds out the
same documents, never trains on them, and the shards are disjoint and cover all training documents, whether the
data is read map-style or streamed. Identical documents hash alike, so duplicates cannot straddle the split.

Map-style (local files by default): a peer's blocks live in an Arrow table (memory-mapped, cached by `datasets`)
and are visited in a permutation seeded by (seed, shard_index, epoch), a new one every epoch, forever.
Streaming (hub datasets by default): documents pass through a seeded shuffle buffer; resuming re-reads the epoch
from its start and skips the blocks already consumed, so it costs time proportional to the progress in the epoch.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from hivemind.utils.logging import get_logger
from transformers import PreTrainedTokenizerBase

from peer.config import DataConfig
from peer.corpus import builtin_corpus_path
from peer.hub import hub_unreachable, offline_mode

logger = get_logger(__name__)

# File extension -> `datasets` builder; for a directory, the first extension in this order that has files wins.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_MAP_BATCH_DOCS = 1000  # documents per tokenize+pack batch (the tail dropped per batch is < one block)
_STREAM_BATCH_DOCS = 64  # documents tokenized together when streaming (batching makes the fast tokenizer faster)
_SHUFFLE_BUFFER_DOCS = 10_000
_EVAL_SHARD = -1


@dataclass
class DataSplits:
    """What the training loop gets: its train stream and the held-out blocks (identical on every peer)."""

    train: BlockStream
    eval_blocks: torch.Tensor  # LongTensor [N_eval, seq_len + 1]


class BlockStream:
    """An endless stream of training blocks that can be checkpointed and resumed exactly."""

    seq_len: int
    num_blocks: int | None  # blocks per epoch; None when streaming (unknown until an epoch ends)

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """Return LongTensor [batch_size, seq_len + 1]; inputs = b[:, :-1], targets = b[:, 1:]."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        """Position in the stream as JSON-able ints: {"epoch": e, "blocks_consumed": blocks taken in epoch e}."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state` so the next batches equal those of a stream that was never interrupted."""
        raise NotImplementedError


def document_bucket(text: str, eval_fraction: float, num_shards: int) -> int:
    """-1 if the document is held out for evaluation, else the index of the training shard it belongs to."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64:
        return _EVAL_SHARD
    return int.from_bytes(digest[8:], "big") % num_shards


def _tokenize_selected(texts: list[Any], tokenizer: PreTrainedTokenizerBase, want: int, eval_fraction: float,
                       num_shards: int) -> list[list[int]]:
    """Token ids (+ end-of-text) of the documents of `texts` that fall in bucket `want`; empty ones are skipped."""
    chosen = [t for t in texts if isinstance(t, str) and t and document_bucket(t, eval_fraction, num_shards) == want]
    if not chosen:
        return []
    eos = tokenizer.eos_token_id
    # verbose=False: documents longer than the tokenizer's model_max_length are expected here (they get packed).
    encoded = tokenizer(chosen, add_special_tokens=False, verbose=False)["input_ids"]
    return [ids + [eos] for ids in encoded]


def _pack_batch(batch: dict[str, list], text_field: str, tokenizer: PreTrainedTokenizerBase, want: int,
                eval_fraction: float, num_shards: int, block_len: int) -> dict[str, list]:
    """`Dataset.map(batched=True)` function: this batch's documents of bucket `want`, packed into blocks."""
    ids = list(itertools.chain.from_iterable(
        _tokenize_selected(batch[text_field], tokenizer, want, eval_fraction, num_shards)))
    n = len(ids) // block_len
    return {"input_ids": [ids[i * block_len:(i + 1) * block_len] for i in range(n)]}


def _pack_stream(text_batches: Iterable[list[Any]], tokenizer: PreTrainedTokenizerBase, want: int,
                 eval_fraction: float, num_shards: int, block_len: int) -> Iterator[np.ndarray]:
    """Blocks of bucket `want` from an iterable of document batches, packed continuously across batches."""
    buffer: list[int] = []
    for texts in text_batches:
        for ids in _tokenize_selected(texts, tokenizer, want, eval_fraction, num_shards):
            buffer.extend(ids)
        n = len(buffer) // block_len
        for i in range(n):
            yield np.asarray(buffer[i * block_len:(i + 1) * block_len], dtype=np.int64)
        del buffer[:n * block_len]


def _batched_texts(examples: Iterable[dict[str, Any]], text_field: str, size: int) -> Iterator[list[Any]]:
    batch = []
    for example in examples:
        batch.append(example[text_field])
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class MapBlockStream(BlockStream):
    """Blocks from an Arrow table, in a fresh seeded permutation each epoch."""

    def __init__(self, blocks: datasets.Dataset, seq_len: int, seed: int, shard_index: int):
        self._blocks = blocks.with_format("numpy")
        self.seq_len = seq_len
        self.num_blocks = len(blocks)
        self._seed = seed
        self._shard_index = shard_index
        self._epoch = 0
        self._position = 0
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            # SeedSequence wants non-negative entries; the mod keeps any int seed valid and distinct.
            key = [self._seed % 2**64, self._shard_index, self._epoch]
            self._perm = np.random.default_rng(np.random.SeedSequence(key)).permutation(self.num_blocks)
        return self._perm

    def next_batch(self, batch_size: int) -> torch.Tensor:
        indices: list[int] = []
        while len(indices) < batch_size:
            if self._position >= self.num_blocks:
                self._epoch += 1
                self._position = 0
                self._perm = None
            take = min(batch_size - len(indices), self.num_blocks - self._position)
            indices.extend(self._permutation()[self._position:self._position + take].tolist())
            self._position += take
        rows = self._blocks[indices]["input_ids"]
        return torch.as_tensor(np.asarray(rows), dtype=torch.long).reshape(batch_size, self.seq_len + 1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "blocks_consumed": self._position, "num_blocks": self.num_blocks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["blocks_consumed"])
        if state.get("num_blocks", self.num_blocks) != self.num_blocks or not 0 <= position <= self.num_blocks:
            # The data or the sharding changed since the checkpoint: an exact resume is impossible, so keep the
            # epoch count (the permutation stays fresh) and restart that epoch.
            logger.warning(f"Data changed since the checkpoint ({state.get('num_blocks')} -> {self.num_blocks} "
                           f"blocks); restarting epoch {epoch} of the train stream from its start")
            position = 0
        self._epoch, self._position, self._perm = epoch, position, None


class StreamingBlockStream(BlockStream):
    """Blocks packed on the fly from a streamed dataset through a seeded shuffle buffer; epochs repeat forever."""

    def __init__(self, stream: datasets.IterableDataset, text_field: str, tokenizer: PreTrainedTokenizerBase,
                 seq_len: int, shard_index: int, eval_fraction: float, num_shards: int):
        self._stream = stream
        self._text_field = text_field
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.num_blocks = None
        self._bucket = (shard_index, eval_fraction, num_shards)
        self._epoch = 0
        self._consumed = 0
        self._iterator: Iterator[np.ndarray] | None = None

    def _epoch_blocks(self, epoch: int) -> Iterator[np.ndarray]:
        # set_epoch reseeds the shuffle (seed + epoch) so each epoch has a new, reproducible order.
        self._stream.set_epoch(epoch)
        want, eval_fraction, num_shards = self._bucket
        batches = _batched_texts(self._stream, self._text_field, _STREAM_BATCH_DOCS)
        return _pack_stream(batches, self._tokenizer, want, eval_fraction, num_shards, self.seq_len + 1)

    def check_nonempty(self) -> None:
        """Raise ValueError unless an epoch yields at least one block (reads only until the first one)."""
        if next(self._epoch_blocks(0), None) is None:
            raise ValueError("the dataset has too few tokens for one training block of this shard "
                             f"(seq_len + 1 = {self.seq_len + 1} tokens)")

    def next_batch(self, batch_size: int) -> torch.Tensor:
        out = []
        while len(out) < batch_size:
            if self._iterator is None:
                self._iterator = self._epoch_blocks(self._epoch)
            block = next(self._iterator, None)
            if block is None:
                if self._consumed == 0:
                    raise ValueError("an epoch of the streamed dataset yielded no training blocks")
                self._epoch += 1
                self._consumed = 0
                self._iterator = None
                continue
            out.append(block)
            self._consumed += 1
        return torch.as_tensor(np.stack(out), dtype=torch.long)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "blocks_consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._consumed = int(state["epoch"]), int(state["blocks_consumed"])
        self._iterator = self._epoch_blocks(self._epoch)
        # Slow by design (see the module docstring): re-read and re-tokenize the epoch up to the saved position.
        skipped = sum(1 for _ in itertools.islice(self._iterator, self._consumed))
        if skipped < self._consumed:
            logger.warning(f"Data changed since the checkpoint: epoch {self._epoch} now has {skipped} blocks, "
                           f"fewer than the {self._consumed} consumed; starting the next epoch")
            self._epoch, self._consumed, self._iterator = self._epoch + 1, 0, None


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(builder name, data files) for a local file or directory; ValueError naming the path otherwise."""
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"unsupported dataset file {path}: expected one of {', '.join(_BUILDERS)}")
        return builder, [str(path)]
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: p.as_posix())
        for ext, builder in _BUILDERS.items():
            matching = [str(p) for p in files if p.suffix.lower() == ext]
            if matching:
                return builder, matching
        raise ValueError(f"dataset directory {path} has no {', '.join(_BUILDERS)} files")
    raise ValueError(f"dataset path {path} does not exist or is not readable")


def _looks_like_path(name: str) -> bool:
    # A hub name is "dataset" or "owner/dataset"; anything anchored or with a data-file suffix is meant locally.
    return (name.startswith(("/", "./", "../", "~", "."))
            or Path(name).suffix.lower() in _BUILDERS or name.count("/") > 1)


def _load(cfg: DataConfig) -> tuple[datasets.Dataset | datasets.IterableDataset, str]:
    """Open cfg.dataset as (dataset, description); ValueError with one line naming the dataset on failure."""
    if cfg.dataset == "builtin":
        path, hub = builtin_corpus_path(), False
    else:
        path = Path(cfg.dataset).expanduser()
        hub = not path.exists() and not _looks_like_path(cfg.dataset)
    streaming = hub if cfg.streaming is None else cfg.streaming
    kwargs: dict[str, Any] = {"split": cfg.split} if hub else {"split": "train"}
    if not hub:
        builder, files = _local_files(path)
        kwargs["data_files"] = files
        if builder == "text":
            # One document per file for a directory of .txt; a single .txt file splits at blank lines instead.
            kwargs.update(sample_by="document" if path.is_dir() else "paragraph", keep_linebreaks=True)
    if hub and not offline_mode():
        reason = hub_unreachable()
        if reason is not None:  # (offline with a cached copy: HF_DATASETS_OFFLINE=1 reads the cache)
            raise ValueError(f"cannot read dataset {cfg.dataset}: it is no local path, and {reason} "
                             f"(set HF_DATASETS_OFFLINE=1 to use a cached copy)")
    try:
        ds = datasets.load_dataset(cfg.dataset if hub else builder, streaming=streaming, **kwargs)
    except Exception as e:  # datasets raises many types (FileNotFound, DatasetGenerationError, Arrow errors, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read dataset {cfg.dataset}: {first}") from e
    return ds, f"{cfg.dataset} ({'streaming' if streaming else 'map-style'})"


def _check_text_field(ds: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig) -> None:
    columns = ds.column_names
    first = None
    if columns is None:  # a stream whose features are unknown until read
        first = next(iter(ds), None)
        columns = list(first) if first is not None else []
    if cfg.text_field not in columns:
        raise ValueError(f"dataset {cfg.dataset} has no column {cfg.text_field!r} (data.text_field); "
                         f"available columns: {', '.join(columns) or 'none'}")
    if first is None:
        first = next(iter(ds), None) if isinstance(ds, datasets.IterableDataset) else (ds[0] if len(ds) else None)
    if first is None:
        raise ValueError(f"dataset {cfg.dataset} is empty")
    if not isinstance(first[cfg.text_field], (str, type(None))):
        raise ValueError(f"column {cfg.text_field!r} of dataset {cfg.dataset} holds "
                         f"{type(first[cfg.text_field]).__name__}, not text")


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    # Map/generate progress bars would interleave with the peer's log lines; restore the caller's setting.
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _open(cfg: DataConfig) -> tuple[datasets.Dataset | datasets.IterableDataset, str]:
    """cfg.dataset opened and checked, reduced to its text column, as (dataset, description)."""
    raw, description = _load(cfg)
    _check_text_field(raw, cfg)
    return raw.select_columns([cfg.text_field]), description


def _eval_blocks_of(raw: datasets.Dataset | datasets.IterableDataset, cfg: DataConfig,
                    tokenizer: PreTrainedTokenizerBase, block_len: int, max_eval_blocks: int) -> torch.Tensor:
    """The first `max_eval_blocks` blocks of the held-out documents in dataset order, packed the same way for
    map-style and streaming data; reading stops as soon as enough blocks exist."""
    eval_list = list(itertools.islice(
        _pack_stream(_text_batches(raw, cfg.text_field), tokenizer, _EVAL_SHARD, cfg.eval_fraction, cfg.num_shards,
                     block_len), max_eval_blocks))
    if not eval_list:
        raise ValueError(f"dataset {cfg.dataset} has too few tokens for one eval block: its held-out documents "
                         f"(data.eval_fraction={cfg.eval_fraction}) give < {block_len} tokens")
    return torch.as_tensor(np.stack(eval_list), dtype=torch.long)


def _text_batches(raw: datasets.Dataset | datasets.IterableDataset, text_field: str) -> Iterable[list[Any]]:
    if isinstance(raw, datasets.IterableDataset):
        return _batched_texts(raw, text_field, _STREAM_BATCH_DOCS)
    return (b[text_field] for b in raw.iter(batch_size=_MAP_BATCH_DOCS))


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-text token")


def build_eval_blocks(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int,
                      max_eval_blocks: int = 64) -> torch.Tensor:
    """Only the held-out blocks of `build_data` (LongTensor [N, seq_len + 1], the same tensor), without packing
    the training shard: what `python -m peer.eval` needs. Same ValueErrors as build_data."""
    _check_tokenizer(tokenizer)
    with _quiet_progress():
        raw, _ = _open(cfg)
        return _eval_blocks_of(raw, cfg, tokenizer, seq_len + 1, max_eval_blocks)


def heldout_documents(cfg: DataConfig) -> Iterator[str]:
    """The held-out documents of cfg.dataset (those `document_bucket` puts in the eval bucket), in dataset order;
    lazily, so a caller that stops early reads no further (a streamed hub dataset is never read whole)."""
    with _quiet_progress():
        raw, _ = _open(cfg)
    for texts in _text_batches(raw, cfg.text_field):
        for text in texts:
            # Empty documents are skipped exactly as packing skips them.
            if (isinstance(text, str) and text
                    and document_bucket(text, cfg.eval_fraction, cfg.num_shards) == _EVAL_SHARD):
                yield text


def build_data(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
               max_eval_blocks: int = 64) -> DataSplits:
    """Open cfg.dataset and return this peer's train stream plus the held-out eval blocks.

    Deterministic given (cfg, tokenizer, seq_len, seed). Raises ValueError (one line naming the cause) for a
    missing/unreadable path, an unsupported file type, a missing text column, or too little text.
    """
    _check_tokenizer(tokenizer)
    block_len = seq_len + 1
    with _quiet_progress():
        raw, description = _open(cfg)
        bucket_args = {"eval_fraction": cfg.eval_fraction, "num_shards": cfg.num_shards}
        # Opened once for both: the eval blocks are exactly what build_eval_blocks returns.
        eval_blocks = _eval_blocks_of(raw, cfg, tokenizer, block_len, max_eval_blocks)

        train: BlockStream
        if isinstance(raw, datasets.IterableDataset):
            key = np.random.SeedSequence([seed % 2**64, cfg.shard_index]).generate_state(1)[0]
            stream = raw.shuffle(seed=int(key), buffer_size=_SHUFFLE_BUFFER_DOCS)
            train = StreamingBlockStream(stream, cfg.text_field, tokenizer, seq_len, cfg.shard_index, **bucket_args)
            train.check_nonempty()
            train_info = "blocks per epoch unknown (streaming)"
        else:
            blocks = raw.map(
                _pack_batch, batched=True, batch_size=_MAP_BATCH_DOCS, remove_columns=raw.column_names,
                # Sequence (not List) so datasets < 4 works too; int32 halves the cache on disk.
                features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), block_len)}),
                fn_kwargs={"text_field": cfg.text_field, "tokenizer": tokenizer, "want": cfg.shard_index,
                           "block_len": block_len, **bucket_args},
            )
            if len(blocks) == 0:
                raise ValueError(f"dataset {cfg.dataset} has too few tokens for one training block of shard "
                                 f"{cfg.shard_index}/{cfg.num_shards} (seq_len + 1 = {block_len} tokens)")
            train = MapBlockStream(blocks, seq_len, seed, cfg.shard_index)
            train_info = f"{len(blocks)} train blocks ({len(blocks) * block_len:,} tokens)"
    logger.info(f"Data {description}, shard {cfg.shard_index}/{cfg.num_shards}: {train_info}; "
                f"{len(eval_blocks)} eval blocks ({eval_blocks.numel():,} tokens) of {block_len} tokens")
    return DataSplits(train=train, eval_blocks=eval_blocks)
