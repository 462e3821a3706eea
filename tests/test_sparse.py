"""Unit tests of sync/sparse.py, the contribution codec: exact roundtrips, error feedback, sizes, and strict
rejection of every kind of malformed blob (each must raise CodecError, never another exception).

Pure CPU, no DHT; small shapes so the whole file runs in seconds. Blobs are tampered with by rebuilding the
msgpack header (never pickle) so each test changes exactly one thing.
"""
from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from sync.sparse import (METHODS, VERSION, CodecError, SparseSpec, blob_digest, decode, encode, encoded_size,
                         pack_bits, unpack_bits)

pytestmark = pytest.mark.unit  # the fast tier: pure decisions, no DHT (python -m pytest -m unit)

PREFIX = struct.Struct("<4sBI")


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(96, 130, generator=gen),          # 12480 elements: 4 chunks, the last one partial
        "norm": torch.randn(64, generator=gen),             # below dense_below: dense fp16
        "emb": torch.randn(4096 * 2 + 7, generator=gen).to(torch.bfloat16),  # last chunk shorter than topk
    }


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def split(blob: bytes) -> tuple[dict, bytes]:
    _, _, hlen = PREFIX.unpack_from(blob)
    return msgpack.unpackb(blob[PREFIX.size:PREFIX.size + hlen]), blob[PREFIX.size + hlen:]


def join(header: dict, body: bytes) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(b"SPSC", VERSION, len(raw)) + raw + body


def section(blob: bytes, name: str, index: int) -> tuple[int, int]:
    """(absolute offset, length) of section `index` of tensor `name`."""
    header, body = split(blob)
    offset = len(blob) - len(body)
    for entry in header["tensors"]:
        for i, length in enumerate(entry[3]):
            if entry[0] == name and i == index:
                return offset, length
            offset += length
    raise KeyError(name)


# ---- roundtrips ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_roundtrip_bit_exact_and_sized(method: str, bits: int) -> None:
    tensors = make_tensors()
    spec = SparseSpec(method=method, bits=bits)
    blob, decoded = encode(tensors, spec)
    out = decode(blob, shapes_of(tensors), max_bytes=len(blob))
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == torch.float32 and out[name].shape == t.shape
        assert torch.equal(out[name], decoded[name]), name
    assert len(blob) == encoded_size(shapes_of(tensors), spec)
    assert len(blob_digest(blob)) == 64
    if method == "fp32":
        assert all(torch.equal(decoded[n], t.float()) for n, t in tensors.items())
    # tiny tensors travel dense whatever the method
    assert torch.equal(decoded["norm"], tensors["norm"].half().float()) or method == "fp32"


def test_sparse_keeps_topk_per_chunk_and_never_padding() -> None:
    tensors = make_tensors()
    _, decoded = encode(tensors, SparseSpec(chunk=4096, topk=64, bits=8))
    w = decoded["w"].reshape(-1)
    nonzero_per_chunk = [int((w[i:i + 4096] != 0).sum()) for i in range(0, w.numel(), 4096)]
    assert nonzero_per_chunk == [64, 64, 64, 64]
    # the kept entries are the largest ones: every kept |x| >= every dropped |x| in the chunk
    x = tensors["w"].reshape(-1)[:4096]
    kept = w[:4096] != 0
    assert x[kept].abs().min() >= x[~kept].abs().max()
    emb = decoded["emb"]
    assert int((emb[8192:] != 0).sum()) == 7 and emb.numel() == 8199


def test_sparse_quantizer_error_2bit() -> None:
    x = torch.randn(4096 * 64, generator=torch.Generator().manual_seed(3))
    _, dec = encode({"x": x}, SparseSpec(bits=2))
    kept = dec["x"] != 0
    rel = ((x[kept] - dec["x"][kept]).norm() / x[kept].norm()).item()
    assert rel < 0.1, rel  # measured 0.072 for Gaussian data


def cumulative_errors(use_ef: bool, rounds: int = 120) -> list[float]:
    """||sum of true deltas - sum of decoded|| / ||sum of true deltas|| after each round."""
    gen = torch.Generator().manual_seed(1)
    drift = torch.randn(64, 256, generator=gen)
    spec = SparseSpec(chunk=1024, topk=32, bits=2)
    ef = torch.zeros_like(drift)
    true_sum, sent_sum, errors = torch.zeros_like(drift), torch.zeros_like(drift), []
    for _ in range(rounds):
        delta = drift + 0.5 * torch.randn(64, 256, generator=gen)
        target = delta + ef if use_ef else delta
        _, dec = encode({"d": target}, spec)
        ef = target - dec["d"]
        true_sum += delta
        sent_sum += dec["d"]
        errors.append(((true_sum - sent_sum).norm() / true_sum.norm()).item())
    return errors


def test_error_feedback_converges() -> None:
    errors = cumulative_errors(use_ef=True)      # measured 0.64 after 10 rounds, 0.125 after 120
    assert errors[-1] < errors[9] / 3, (errors[9], errors[-1])
    assert errors[-1] < 0.2
    without = cumulative_errors(use_ef=False)    # without feedback the dropped mass is lost for good (0.84)
    assert without[-1] > 0.7


@pytest.mark.parametrize("width", [1, 2, 3, 8, 12, 16])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 1001])
def test_pack_bits_roundtrip(width: int, count: int) -> None:
    values = torch.randint(0, 1 << width, (count,), generator=torch.Generator().manual_seed(count + width))
    packed = pack_bits(values, width)
    assert len(packed) == -(-count * width // 8)
    assert torch.equal(unpack_bits(packed, count, width), values)


def test_unpack_bits_rejects_padding_bits_and_length() -> None:
    packed = bytearray(pack_bits(torch.tensor([4095]), 12))
    packed[-1] |= 0x80
    with pytest.raises(CodecError):
        unpack_bits(bytes(packed), 1, 12)
    with pytest.raises(CodecError):
        unpack_bits(b"\x00" * 3, 1, 12)


def test_encoded_size_matches_odd_shapes() -> None:
    shapes = {"a": (3, 4097), "b": (), "c": (0, 5), "d": (65536 + 1,)}
    tensors = {k: torch.randn(s) for k, s in shapes.items()}
    for method in METHODS:
        spec = SparseSpec(method=method, chunk=8192, topk=100, bits=4, dense_below=100)
        blob, dec = encode(tensors, spec)
        assert len(blob) == encoded_size(shapes, spec)
        out = decode(blob, shapes)
        assert all(torch.equal(out[k], dec[k]) for k in shapes)


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(CodecError):
        encode({"x": torch.tensor([1.0, float("nan")])}, SparseSpec())
    with pytest.raises(CodecError):
        encode({"x": torch.full((10,), 1e6)}, SparseSpec(method="fp16"))  # overflows float16
    with pytest.raises(CodecError):
        encode({"x": torch.ones(10)}, SparseSpec(chunk=3000))
    with pytest.raises(CodecError):
        encode({"x": torch.ones(10, dtype=torch.int32)}, SparseSpec())


# ---- rejection of hostile blobs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparse_blob() -> tuple[bytes, dict[str, tuple[int, ...]]]:
    tensors = make_tensors()
    blob, _ = encode(tensors, SparseSpec())
    return blob, shapes_of(tensors)


def rejects(blob: bytes, expected: dict, **kw) -> str:
    with pytest.raises(CodecError) as info:
        decode(blob, expected, **kw)
    return str(info.value)


def test_rejects_truncated_and_extra(sparse_blob) -> None:
    blob, shapes = sparse_blob
    for cut in (0, 3, 8, 20, len(blob) // 2, len(blob) - 1):
        rejects(blob[:cut], shapes)
    rejects(blob + b"\x00", shapes)
    rejects(b"XXXX" + blob[4:], shapes)


def test_rejects_names_and_shapes(sparse_blob) -> None:
    blob, shapes = sparse_blob
    rejects(blob, {**shapes, "other": (3,)})
    rejects(blob, {k: v for k, v in shapes.items() if k != "norm"})
    rejects(blob, {("W" if k == "w" else k): v for k, v in shapes.items()})
    rejects(blob, {**shapes, "w": (130, 96)})
    reordered = dict(reversed(list(shapes.items())))
    assert list(decode(blob, reordered)) == list(reordered)  # order of `expected` is free
    header, body = split(blob)
    header["tensors"].append(header["tensors"][0])
    rejects(join(header, body), {**shapes, "x": (1,)})  # duplicate name, count matches


def test_rejects_lying_section_sizes(sparse_blob) -> None:
    blob, shapes = sparse_blob
    header, body = split(blob)
    header["tensors"][0][3][0] += 1
    header["tensors"][0][3][1] -= 1   # total unchanged: only the per-section check can catch it
    rejects(join(header, body), shapes)
    header, body = split(blob)
    header["tensors"][0][3][0] = float(header["tensors"][0][3][0])
    rejects(join(header, body), shapes)
    header, body = split(blob)
    header["tensors"][1][2] = "fp32"  # method changes what the sections must be
    rejects(join(header, body), shapes)


def test_rejects_huge_header_and_garbage_header(sparse_blob) -> None:
    blob, shapes = sparse_blob
    rejects(PREFIX.pack(b"SPSC", VERSION, 2**32 - 1) + blob[PREFIX.size:], shapes)
    rejects(PREFIX.pack(b"SPSC", VERSION, 5) + b"\xc1\xc1\xc1\xc1\xc1", shapes)
    rejects(PREFIX.pack(b"SPSC", VERSION, 5) + b"\xdd\xff\xff\xff\xff", shapes)  # array claiming 4G entries
    rejects(join({"chunk": 4096}, b""), shapes)
    rejects(join([1, 2, 3], b""), shapes)


@pytest.mark.parametrize("field,value", [("chunk", 3000), ("chunk", 1 << 17), ("chunk", 1), ("topk", 0),
                                         ("topk", 1 << 20), ("bits", 3), ("bits", 16), ("bits", True),
                                         ("chunk", "4096")])
def test_rejects_params_out_of_range(sparse_blob, field: str, value: object) -> None:
    blob, shapes = sparse_blob
    header, body = split(blob)
    header[field] = value
    rejects(join(header, body), shapes)


def test_rejects_max_bytes(sparse_blob) -> None:
    blob, shapes = sparse_blob
    assert "max_bytes" in rejects(blob, shapes, max_bytes=len(blob) - 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 3.3e38])  # 3.3e38 * 1.2433 overflows fp32
def test_rejects_bad_scales(sparse_blob, bad: float) -> None:
    blob, shapes = sparse_blob
    offset, length = section(blob, "w", 3)
    patched = bytearray(blob)
    patched[offset:offset + 2] = torch.tensor([bad], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    rejects(bytes(patched), shapes)


@pytest.mark.parametrize("method,dtype,index", [("fp16", torch.float16, 0), ("fp32", torch.float32, 0),
                                                ("8bit", torch.float32, 1)])
def test_rejects_non_finite_dense(method: str, dtype: torch.dtype, index: int) -> None:
    tensors = make_tensors()
    blob, _ = encode(tensors, SparseSpec(method=method))
    offset, _ = section(blob, "w", index)
    size = torch.tensor([], dtype=dtype).element_size()
    for bad in (float("nan"), float("-inf")):
        patched = bytearray(blob)
        patched[offset:offset + size] = torch.tensor([bad], dtype=dtype).numpy().tobytes()
        rejects(bytes(patched), shapes_of(tensors))


def test_rejects_8bit_code_minus_128() -> None:
    tensors = make_tensors()
    blob, _ = encode(tensors, SparseSpec(method="8bit"))
    offset, _ = section(blob, "w", 0)
    patched = bytearray(blob)
    patched[offset] = 0x80
    rejects(bytes(patched), shapes_of(tensors))


# ---- Elias-Fano indices ----------------------------------------------------------------------------------------

def bits_to_bytes(bits: list[int]) -> bytes:
    out = bytearray(-(-len(bits) // 8))
    for i, b in enumerate(bits):
        out[i // 8] |= b << (i % 8)
    return bytes(out)


def ef_reference(chunks: list[list[int]], chunk: int) -> tuple[bytes, bytes]:
    """Pure-Python Elias-Fano (upper, low) sections of each chunk's index list, taken as given (no sorting, no
    checks), so tests can also build hostile sections."""
    upper, low = [], []
    for idx in chunks:
        k = len(idx)
        l = max(0, (chunk // k).bit_length() - 1)
        vec = [0] * (k + (chunk >> l))
        for i, x in enumerate(idx):
            vec[(x >> l) + i] = 1
            low.extend((x >> b) & 1 for b in range(l))
        upper.extend(vec)
    return bits_to_bytes(upper), bits_to_bytes(low)


def kept_indices(x: torch.Tensor, chunk: int, topk: int) -> list[list[int]]:
    """Each chunk's kept indices (largest |x|, ascending), from scratch."""
    flat = x.reshape(-1).float()
    out = []
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].abs()
        out.append(sorted(torch.argsort(part, descending=True)[:min(topk, chunk, part.numel())].tolist()))
    return out


def with_sections(blob: bytes, name: str, parts: dict[int, bytes]) -> bytes:
    """The blob with sections of tensor `name` replaced by same-length bytes."""
    for index, data in parts.items():
        offset, length = section(blob, name, index)
        assert len(data) == length, (index, len(data), length)
        blob = blob[:offset] + data + blob[offset + length:]
    return blob


@pytest.mark.parametrize("chunk,topk,numel", [
    (8, 1, 8 * 5 + 3), (8, 3, 8 * 5 + 3), (8, 4, 8 * 5 + 1), (8, 8, 8 * 5 + 3), (8, 16, 8 * 2 + 5), (8, 5, 8),
    (4096, 1, 4096 * 2 + 7), (4096, 16, 4096 * 2 + 700), (4096, 64, 4096 * 3 + 33), (4096, 100, 4096 * 2 + 4095),
    (4096, 256, 4096 * 2 + 300), (4096, 2048, 4096 + 3000), (4096, 4096, 4096 * 2 + 5), (1024, 1000, 1024 * 3),
])
def test_elias_fano_indices_roundtrip_exactly(chunk: int, topk: int, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + topk))
    spec = SparseSpec(chunk=chunk, topk=topk, bits=8, dense_below=1)
    blob, dec = encode({"x": x}, spec)
    assert len(blob) == encoded_size({"x": (numel,)}, spec)
    out = decode(blob, {"x": (numel,)})["x"]
    assert torch.equal(out, dec["x"])
    want = kept_indices(x, chunk, topk)
    got = [torch.nonzero(out[s:s + chunk]).reshape(-1).tolist() for s in range(0, numel, chunk)]
    assert got == want  # 8-bit levels are never 0 and scales are > 0: nonzero == kept
    # the sections are exactly the reference Elias-Fano coding of those index sets
    upper, low = ef_reference(want, chunk)
    assert [blob[o:o + n] for o, n in (section(blob, "x", 0), section(blob, "x", 1))] == [upper, low]


@pytest.mark.parametrize("topk,bits_per_index", [(16, 10), (64, 8), (128, 7), (256, 6), (4096, 2)])
def test_elias_fano_size_per_index(topk: int, bits_per_index: int) -> None:
    x = torch.randn(4096 * 8)
    blob, _ = encode({"x": x}, SparseSpec(topk=topk))
    index_bytes = section(blob, "x", 0)[1] + section(blob, "x", 1)[1]
    assert index_bytes * 8 == 8 * topk * bits_per_index


def test_encoded_size_matches_many_shapes() -> None:
    gen = torch.Generator().manual_seed(5)
    shapes = [(1,), (7,), (8,), (9,), (63, 65), (4095,), (4096,), (4097,), (3, 4096), (8191,), (2, 3, 1000)]
    for chunk, topk, bits in [(8, 1, 2), (8, 3, 4), (64, 64, 8), (256, 5, 2), (4096, 64, 2), (4096, 100, 4),
                              (4096, 256, 8), (1024, 2000, 2)]:
        spec = SparseSpec(chunk=chunk, topk=topk, bits=bits, dense_below=1)
        tensors = {f"t{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
        blob, dec = encode(tensors, spec)
        assert len(blob) == encoded_size({n: tuple(t.shape) for n, t in tensors.items()}, spec), (chunk, topk)
        out = decode(blob, {n: tuple(t.shape) for n, t in tensors.items()}, max_bytes=len(blob))
        assert all(torch.equal(out[n], dec[n]) for n in tensors)


def test_rejects_version_1(sparse_blob) -> None:
    blob, shapes = sparse_blob
    assert blob[4] == VERSION == 2
    assert "version 1" in rejects(blob[:4] + bytes([1]) + blob[5:], shapes)


def _w_indices(blob: bytes, shapes: dict) -> list[list[int]]:
    w = decode(blob, shapes)["w"].reshape(-1)  # 2-bit levels are never 0: nonzero == kept
    return [torch.nonzero(w[s:s + 4096]).reshape(-1).tolist() for s in range(0, w.numel(), 4096)]


def test_rejects_upper_vector_with_a_bit_too_many_or_too_few(sparse_blob) -> None:
    blob, shapes = sparse_blob
    offset, length = section(blob, "w", 0)  # 4 chunks of 64 + 64 bits, 16 bytes each, no padding
    assert length == 64
    upper = torch.frombuffer(bytearray(blob[offset:offset + length]), dtype=torch.uint8)
    bits = ((upper.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1).tolist()
    assert [sum(bits[c * 128:(c + 1) * 128]) for c in range(4)] == [64] * 4
    zero, one = bits.index(0), bits.index(1)
    for flips in ([zero], [one], [zero, 128 + bits[128:].index(1)], [127]):  # one more, one fewer, both (total kept)
        patched = list(bits)                                                  # and the last bit (h = u >> l)
        for f in flips:
            patched[f] ^= 1
        assert "set bits" in rejects(with_sections(blob, "w", {0: bits_to_bytes(patched)}), shapes)
    # every single-bit flip in an upper vector changes its count of set bits: all are refused
    for f in range(0, len(bits), 7):
        patched = list(bits)
        patched[f] ^= 1
        rejects(with_sections(blob, "w", {0: bits_to_bytes(patched)}), shapes)


def test_rejects_duplicate_unsorted_and_padding_indices(sparse_blob) -> None:
    blob, shapes = sparse_blob
    idx = _w_indices(blob, shapes)
    assert [len(c) for c in idx] == [64] * 4
    assert with_sections(blob, "w", dict(enumerate(ef_reference(idx, 4096)))) == blob  # the reference agrees
    # two set bits naming the same index: equal high parts (adjacent bits) and equal low bits
    dup = [list(c) for c in idx]
    dup[1][5] = dup[1][4]
    assert "duplicate" in rejects(with_sections(blob, "w", dict(enumerate(ef_reference(dup, 4096)))), shapes)
    # the same set in another order: refused (only ascending order within a chunk is valid)
    swapped = [list(c) for c in idx]
    swapped[2] = sorted(swapped[2], reverse=True)
    rejects(with_sections(blob, "w", dict(enumerate(ef_reference(swapped, 4096)))), shapes)
    # "w" has 12480 elements: chunk 3 holds only 192 real ones
    for bad in (192, 4095):
        pad = [list(c) for c in idx]
        pad[3][-1] = bad
        assert "padding" in rejects(with_sections(blob, "w", dict(enumerate(ef_reference(pad, 4096)))), shapes)
    # an index past the chunk (h = u >> l) in a full chunk
    past = [list(c) for c in idx]
    past[0][-1] = 4096
    rejects(with_sections(blob, "w", dict(enumerate(ef_reference(past, 4096)))), shapes)


def test_rejects_short_last_chunk_index_and_padding_bits() -> None:
    tensors = make_tensors()
    blob, _ = encode(tensors, SparseSpec())
    shapes = shapes_of(tensors)
    emb = decode(blob, shapes)["emb"]  # 8199 elements: the last chunk keeps all of its 7, at l = 9
    idx = [torch.nonzero(emb[s:s + 4096]).reshape(-1).tolist() for s in range(0, 8199, 4096)]
    assert [len(c) for c in idx] == [64, 64, 7] and idx[2] == list(range(7))
    upper, low = ef_reference(idx, 4096)
    assert with_sections(blob, "emb", {0: upper, 1: low}) == blob
    bad = [idx[0], idx[1], [0, 1, 2, 3, 4, 5, 7]]
    assert "padding" in rejects(with_sections(blob, "emb", dict(enumerate(ef_reference(bad, 4096)))), shapes)
    # 2·128 + 15 upper bits and 2·64·6 + 7·9 low bits: each section's last byte has one unused bit
    for index in (0, 1):
        offset, length = section(blob, "emb", index)
        patched = bytearray(blob)
        patched[offset + length - 1] |= 0x80
        assert "padding bits" in rejects(bytes(patched), shapes)


def _decodes_or_refuses(blob: bytes, shapes: dict) -> bool:
    """True if decoded (to finite tensors of the right shapes), False if refused with CodecError."""
    try:
        out = decode(blob, shapes)
    except CodecError:
        return False
    assert list(out) == list(shapes)
    for name, shape in shapes.items():
        assert out[name].shape == shape and out[name].dtype == torch.float32
        assert torch.isfinite(out[name]).all()
    return True


def test_never_other_exception_on_random_corruption(sparse_blob) -> None:
    blob, shapes = sparse_blob
    gen = torch.Generator().manual_seed(7)
    for _ in range(300):
        patched = bytearray(blob)
        for pos in torch.randint(0, len(blob), (3,), generator=gen).tolist():
            patched[pos] = int(torch.randint(0, 256, (1,), generator=gen))
        _decodes_or_refuses(bytes(patched), shapes)


def test_random_corruption_of_sparse_sections(sparse_blob) -> None:
    blob, shapes = sparse_blob
    gen = torch.Generator().manual_seed(11)
    start, _ = section(blob, "w", 0)
    end = sum(section(blob, "emb", 3))  # every sparse section of "w" and "emb" ("norm" is fp16 in between)
    decoded = 0
    for _ in range(300):
        patched = bytearray(blob)
        for pos in torch.randint(start, end, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist():
            patched[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        decoded += _decodes_or_refuses(bytes(patched), shapes)
    assert 0 < decoded < 300  # some flips (value codes, low bits) still decode, many are refused
