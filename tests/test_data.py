"""Tests of the data pipeline: built-in tokenizer, built-in corpus, block packing, held-out split, shards, resume.

Everything runs offline on real data (the corpus built from this Python's stdlib and small files written here).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from peer.config import DataConfig
from peer.corpus import builtin_corpus_path
from peer.data import BlockStream, DataSplits, build_data, document_bucket
from peer.tokenizer import build_tokenizer

SEQ = 32
MARKER = re.compile(r"D(\d{4})E")


@pytest.fixture(scope="module")
def isolated_caches(tmp_path_factory):
    """Point the corpus cache and datasets' cache at temp dirs for the whole module (built once, shared)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPES_CACHE_DIR", str(tmp_path_factory.mktemp("spes_cache")))
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        yield


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("builtin")


@pytest.fixture(scope="module")
def corpus(isolated_caches) -> Path:
    return builtin_corpus_path()


def write_docs(path: Path, n: int = 300, reps: int = 15) -> list[str]:
    """A JSONL file of n distinct documents; document i is its marker "D%04dE " repeated, so any block piece of it
    longer than a few tokens names it."""
    docs = [f"D{i:04d}E " * reps for i in range(n)]
    path.write_text("".join(json.dumps({"text": d, "meta": i}) + "\n" for i, d in enumerate(docs)))
    return docs


def doc_ids(tokenizer, blocks: torch.Tensor) -> set[int]:
    return {int(m) for row in blocks for m in MARKER.findall(tokenizer.decode(row.tolist()))}


def cfg_for(path: Path, **kw) -> DataConfig:
    kw.setdefault("eval_fraction", 0.1)
    return DataConfig(dataset=str(path), **kw)


def take(stream: BlockStream, n_batches: int, bs: int = 8) -> list[torch.Tensor]:
    return [stream.next_batch(bs) for _ in range(n_batches)]


# --- tokenizer ---------------------------------------------------------------------------------------------------

def test_builtin_tokenizer_round_trip_and_save_load(tok, tmp_path):
    text = "def f(x):\n\treturn x  # naïve café — 日本語 🎉\r\n\x00end "
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte value
    assert tok.decode(ids) == text
    assert len(tok) == 257 and tok.eos_token_id == 256 and tok.pad_token_id == 256
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids) == text and loaded.eos_token_id == 256


def test_tokenizer_load_error_names_it(tmp_path):
    with pytest.raises(ValueError, match="no-such-tokenizer"):
        build_tokenizer(str(tmp_path / "no-such-tokenizer"))


# --- built-in corpus ---------------------------------------------------------------------------------------------

def test_builtin_corpus_is_real_text_and_deterministic(corpus, tok, tmp_path, monkeypatch):
    lines = corpus.read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) > 1000
    assert corpus.stat().st_size > 2_000_000
    assert all(set(d) == {"text", "source"} and len(d["text"]) >= 200 for d in docs)
    words = set(re.findall(r"[a-z]+", " ".join(d["text"] for d in docs[:400])))
    assert {"list", "def", "the", "return"} <= words
    mtime = corpus.stat().st_mtime_ns
    assert builtin_corpus_path() == corpus and corpus.stat().st_mtime_ns == mtime  # cached, not rebuilt
    monkeypatch.setenv("SPES_CACHE_DIR", str(tmp_path))
    again = builtin_corpus_path()
    assert again.parent == tmp_path and again.read_bytes() == corpus.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


# --- build_data on the built-in corpus -----------------------------------------------------------------------------

def test_build_data_builtin(corpus, tok):
    data = build_data(DataConfig(), tok, seq_len=64, seed=0, max_eval_blocks=16)
    assert isinstance(data, DataSplits) and isinstance(data.train, BlockStream)
    batch = data.train.next_batch(4)
    assert batch.shape == (4, 65) and batch.dtype == torch.long
    assert data.eval_blocks.shape == (16, 65) and data.eval_blocks.dtype == torch.long
    assert 0 <= int(batch.min()) and int(batch.max()) < len(tok) and int(data.eval_blocks.max()) < len(tok)
    assert data.train.num_blocks > 10_000
    again = build_data(DataConfig(), tok, seq_len=64, seed=0, max_eval_blocks=16)
    assert torch.equal(again.eval_blocks, data.eval_blocks) and torch.equal(again.train.next_batch(4), batch)
    other_seed = build_data(DataConfig(), tok, seq_len=64, seed=1, max_eval_blocks=16)
    assert torch.equal(other_seed.eval_blocks, data.eval_blocks)  # held-out set does not depend on the seed
    assert not torch.equal(other_seed.train.next_batch(4), batch)


# --- local data: split, shards, epochs, resume ---------------------------------------------------------------------

@pytest.mark.parametrize("streaming", [False, True])
def test_eval_documents_never_trained_on(isolated_caches, tok, tmp_path, streaming):
    write_docs(tmp_path / "d.jsonl")
    cfg = cfg_for(tmp_path / "d.jsonl", streaming=streaming)
    data = build_data(cfg, tok, seq_len=SEQ, seed=0)
    held_out = {i for i in range(300) if document_bucket(f"D{i:04d}E " * 15, 0.1, 1) == -1}
    assert 10 < len(held_out) < 60
    assert doc_ids(tok, data.eval_blocks) <= held_out
    seen = doc_ids(tok, torch.cat(take(data.train, 150, 8)))  # > 1 epoch (~1000 blocks)
    assert not seen & held_out
    assert seen == set(range(300)) - held_out


def test_streaming_and_map_style_agree_on_eval(isolated_caches, tok, tmp_path):
    write_docs(tmp_path / "d.jsonl")
    a = build_data(cfg_for(tmp_path / "d.jsonl", streaming=False), tok, seq_len=SEQ, seed=0)
    b = build_data(cfg_for(tmp_path / "d.jsonl", streaming=True), tok, seq_len=SEQ, seed=0)
    assert torch.equal(a.eval_blocks, b.eval_blocks)


@pytest.mark.parametrize("streaming", [False, True])
def test_shards_are_disjoint_and_cover_training_documents(isolated_caches, tok, tmp_path, streaming):
    write_docs(tmp_path / "d.jsonl")
    everything = build_data(cfg_for(tmp_path / "d.jsonl", streaming=streaming), tok, seq_len=SEQ, seed=0)
    all_train = doc_ids(tok, torch.cat(take(everything.train, 130)))
    shards = []
    for i in range(2):
        cfg = cfg_for(tmp_path / "d.jsonl", streaming=streaming, shard_index=i, num_shards=2)
        data = build_data(cfg, tok, seq_len=SEQ, seed=0)
        assert torch.equal(data.eval_blocks, everything.eval_blocks)
        shards.append(doc_ids(tok, torch.cat(take(data.train, 80))))
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert shards[0] | shards[1] == all_train


def test_map_style_epochs_are_fresh_permutations(isolated_caches, tok, tmp_path):
    write_docs(tmp_path / "d.jsonl")
    train = build_data(cfg_for(tmp_path / "d.jsonl"), tok, seq_len=SEQ, seed=0).train
    n = train.num_blocks
    rows = torch.cat([train.next_batch(1) for _ in range(2 * n)])
    first, second = rows[:n], rows[n:]
    assert train.state_dict() == {"epoch": 1, "blocks_consumed": n, "num_blocks": n}
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(first) == key(second) and not torch.equal(first, second)
    assert len(set(map(tuple, first.tolist()))) == n  # each block once per epoch


@pytest.mark.parametrize("streaming", [False, True])
def test_exact_resume_across_epoch_boundary(isolated_caches, tok, tmp_path, streaming):
    write_docs(tmp_path / "d.jsonl", n=120)
    cfg = cfg_for(tmp_path / "d.jsonl", streaming=streaming)
    reference = build_data(cfg, tok, seq_len=SEQ, seed=3).train
    expected = take(reference, 90, 7)  # ~370 blocks per epoch: this crosses one epoch boundary
    assert reference.state_dict()["epoch"] == 1
    for stop in (5, 60):  # inside epoch 0, and after the boundary
        resumed = build_data(cfg, tok, seq_len=SEQ, seed=3).train
        take(resumed, stop, 7)
        state = json.loads(json.dumps(resumed.state_dict()))
        assert all(isinstance(v, int) for v in state.values())
        fresh = build_data(cfg, tok, seq_len=SEQ, seed=3).train
        fresh.load_state_dict(state)
        got = take(fresh, 90 - stop, 7)
        assert all(torch.equal(g, e) for g, e in zip(got, expected[stop:], strict=True))


@pytest.mark.parametrize("fmt", ["json", "parquet", "txt-dir", "txt-file"])
def test_other_local_formats(isolated_caches, tok, tmp_path, fmt):
    docs = [f"D{i:04d}E " * 15 for i in range(200)]
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([{"body": d} for d in docs]))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_dict({"body": docs}).to_parquet(str(path))
    elif fmt == "txt-dir":
        path = tmp_path / "texts"
        path.mkdir()
        for i, d in enumerate(docs):
            (path / f"{i:04d}.txt").write_text(d)
    else:
        path = tmp_path / "d.txt"
        path.write_text("\n\n".join(docs))  # one document per blank-line separated paragraph
    field = "body" if fmt in ("json", "parquet") else "text"
    data = build_data(cfg_for(path, text_field=field), tok, seq_len=SEQ, seed=0)
    held_out = {i for i, d in enumerate(docs) if document_bucket(d, 0.1, 1) == -1}
    seen = doc_ids(tok, torch.cat(take(data.train, 100)))
    assert doc_ids(tok, data.eval_blocks) <= held_out and seen == set(range(200)) - held_out


# --- bad input ---------------------------------------------------------------------------------------------------

def test_missing_path(isolated_caches, tok, tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl"):
        build_data(cfg_for(tmp_path / "nope.jsonl"), tok, seq_len=SEQ, seed=0)


@pytest.mark.parametrize("streaming", [False, True])
def test_wrong_text_field(isolated_caches, tok, tmp_path, streaming):
    write_docs(tmp_path / "d.jsonl", n=20)
    with pytest.raises(ValueError, match=r"'content'.*available columns: text, meta"):
        build_data(cfg_for(tmp_path / "d.jsonl", text_field="content", streaming=streaming), tok, seq_len=SEQ, seed=0)


def test_unsupported_extension(isolated_caches, tok, tmp_path):
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"unsupported.*d\.csv"):
        build_data(cfg_for(tmp_path / "d.csv"), tok, seq_len=SEQ, seed=0)


def test_corrupt_file(isolated_caches, tok, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"cannot read dataset .*d\.jsonl"):
        build_data(cfg_for(tmp_path / "d.jsonl"), tok, seq_len=SEQ, seed=0)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("eval_fraction", [0.1, 0.95])  # too little for eval / enough for eval but not train
def test_too_little_text(isolated_caches, tok, tmp_path, streaming, eval_fraction):
    write_docs(tmp_path / "d.jsonl", n=40, reps=2)  # 40 docs x 15 tokens
    cfg = cfg_for(tmp_path / "d.jsonl", streaming=streaming, eval_fraction=eval_fraction)
    with pytest.raises(ValueError, match="too few tokens for one " + ("eval" if eval_fraction < 0.5 else "train")):
        build_data(cfg, tok, seq_len=200, seed=0)
