"""Tensor (de)serialization for expert and state transfers (sync/transfer.py): hivemind's codecs, chosen per
tensor, and bounded decoding of whatever a remote peer sent. Nothing received is unpickled."""
from __future__ import annotations

import re
from contextlib import suppress

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

_CT = runtime_pb2.CompressionType
# UNIFORM_8BIT works on any float tensor (bf16 included) with torch alone; BLOCKWISE_8BIT needs bitsandbytes.
COMPRESSION_TYPES = {"none": _CT.NONE, "fp16": _CT.FLOAT16, "8bit": _CT.UNIFORM_8BIT}
# Below this size the 8-bit codebook (256 fp32 + 8 bytes) costs more than it saves: send 16-bit instead.
MIN_8BIT_NUMEL = 4096
_QUANTIZED = (_CT.UNIFORM_8BIT, _CT.QUANTILE_8BIT)
_ACCEPTED_COMPRESSION = (_CT.NONE, _CT.FLOAT16, _CT.MEANSTD_16BIT, *_QUANTIZED)
_FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}
_ACCEPTED_DTYPES = set(_FLOAT_DTYPES) | {"int8", "int16", "int32", "int64", "uint8", "bool"}

class MalformedResponse(ValueError):
    """The remote peer answered with something that is not a well-formed expert."""


class IncompleteResponse(ConnectionError):
    """The stream ended before every announced tensor arrived: seen rarely on loopback (~1 in 500 fetches)
    although the server sent everything, so it is treated as a transport failure and retried, not refused."""


def serialize_tensor(tensor: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
    """Serialize with the configured codec, choosing a cheaper or safe fallback where the codec does not fit."""
    if compression == _CT.UNIFORM_8BIT and tensor.is_floating_point() and tensor.numel() >= MIN_8BIT_NUMEL:
        with suppress(Exception):  # the codec may fail on odd values; 16-bit below is always possible
            return serialize_torch_tensor(tensor, _CT.UNIFORM_8BIT)
    if not tensor.is_floating_point() or compression == _CT.NONE and tensor.dtype != torch.bfloat16:
        return serialize_torch_tensor(tensor, _CT.NONE)
    if tensor.dtype == torch.bfloat16:
        # Already 16 bits: send the raw bits (exact). hivemind's own NONE codec would widen bf16 to fp32 unless
        # USE_LEGACY_BFLOAT16=0, and its FLOAT16 codec refuses bf16; its NONE decoder reads this form either way.
        return runtime_pb2.Tensor(compression=_CT.NONE, buffer=tensor.view(torch.int16).numpy().tobytes(),
                                  size=tensor.shape, dtype="bfloat16")
    if tensor.dtype == torch.float16:
        return serialize_torch_tensor(tensor, _CT.NONE)
    return serialize_torch_tensor(tensor, _CT.FLOAT16)


def extract_quantized(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a UNIFORM_8BIT / QUANTILE_8BIT tensor: [int64 n][n fp32 codebook][uint8 indices].

    hivemind 1.1.12's own `Quantization.extract` calls int() on a 1-element array, which the installed numpy 2.4 refuses,
    so every 8-bit tensor fails to decode there; this is the same format, decoded with bounds checks.
    """
    buffer = serialized.buffer
    if len(buffer) < 8 or serialized.dtype not in _FLOAT_DTYPES:
        raise MalformedResponse("bad 8-bit tensor header")
    codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    if not 0 < codebook_size <= 256 or len(buffer) < 8 + 4 * codebook_size:
        raise MalformedResponse(f"bad 8-bit codebook size {codebook_size}")
    codebook = torch.as_tensor(np.frombuffer(buffer, offset=8, count=codebook_size, dtype=np.float32).copy())
    indices = torch.as_tensor(np.frombuffer(buffer, offset=8 + 4 * codebook_size, dtype=np.uint8).copy())
    shape = tuple(serialized.size)
    if int(np.prod(shape, dtype=np.int64)) != indices.numel():
        raise MalformedResponse("8-bit tensor size does not match its payload")
    # An index past a short codebook raises IndexError in the lookup: the caller treats that as malformed.
    return codebook.to(_FLOAT_DTYPES[serialized.dtype])[indices.long()].reshape(shape)


def deserialize_parts(parts: list[runtime_pb2.Tensor]) -> torch.Tensor:
    """Reassemble one streamed tensor and decode it; any inconsistency raises MalformedResponse."""
    head = parts[0]
    if head.compression not in _ACCEPTED_COMPRESSION or head.dtype not in _ACCEPTED_DTYPES:
        raise MalformedResponse(f"unsupported tensor encoding {head.compression}/{head.dtype[:32]!r}")
    if len(parts) != max(head.chunks, 1):
        raise MalformedResponse(f"tensor announced {head.chunks} parts, got {len(parts)}")
    serialized = combine_from_streaming(parts)
    try:
        if serialized.compression in _QUANTIZED:
            tensor = extract_quantized(serialized)
        else:
            tensor = deserialize_torch_tensor(serialized)
    except MalformedResponse:
        raise
    except Exception as e:  # numpy / torch errors on inconsistent sizes or buffers
        raise MalformedResponse(f"undecodable tensor: {type(e).__name__}: {str(e)[:200]}") from None
    # The sender chooses requires_grad on the wire; a received value must never join an autograd graph.
    return tensor.detach().requires_grad_(False)


# ---- wire format of sync/transfer.py's requests and responses -------------------------------------------------

# ASCII digits only ("\d" would accept other scripts' digits); the length bound keeps int() cheap. An optional
# "m" asks for the owner's optimizer moments of the expert instead of its values (handoff, sync/fetch.py); "s0"
# for a round's synchronized shared values (a joiner's or a repairing peer's download, sync/fetch.py).
_UID_RE = re.compile(r"([ms]?)([0-9]{1,9})@([0-9]{1,18})")
_MAX_NAMES, _MAX_NAME_LEN = 100_000, 1_000
_MAX_REQUEST_METADATA = 256


# The store key of a round's synchronized shared values, served as `"s0@{round}"` (sync/contributions.py).
SHARED_KEY = -1


def make_uid(expert: int, round_id: int, moments: bool = False) -> str:
    """The request uid of `expert` (or SHARED_KEY: the shared tensors) as of `round_id`; see parse_uid."""
    if expert == SHARED_KEY:
        return f"s0@{round_id}"
    return f"{'m' if moments else ''}{expert}@{round_id}"


def parse_uid(uid: str) -> tuple[bool, int, int] | None:
    """(moments?, expert, round) of a request uid "[m]{expert}@{round}" or "s0@{round}" (expert SHARED_KEY: a
    round's shared result), None if malformed."""
    match = _UID_RE.fullmatch(uid) if isinstance(uid, str) and len(uid) <= 32 else None
    if not match or (match.group(1) == "s" and match.group(2) != "0"):
        return None
    expert = SHARED_KEY if match.group(1) == "s" else int(match.group(2))
    return match.group(1) == "m", expert, int(match.group(3))


def parse_request_metadata(raw: bytes) -> tuple[bool, int | None, bool]:
    """(well-formed, min_round, bf16) of a request's optional metadata (sync/transfer.py). bf16: the fetcher stores
    the copy in bfloat16, so more precision than that would be bytes it throws away. Unknown keys are ignored."""
    if not raw:
        return True, None, False
    if len(raw) > _MAX_REQUEST_METADATA:
        return False, None, False
    try:
        meta = MSGPackSerializer.loads(raw)
    except Exception:
        return False, None, False
    if not isinstance(meta, dict):
        return False, None, False
    min_round, bf16 = meta.get("min_round"), meta.get("bf16", False)
    if min_round is not None and (isinstance(min_round, bool) or not isinstance(min_round, int) or min_round < 0):
        return False, None, False
    if not isinstance(bf16, bool):
        return False, None, False
    return True, min_round, bf16


def parse_metadata(raw: bytes) -> dict:
    if not raw:
        raise MalformedResponse("first message carries no metadata")
    try:
        meta = MSGPackSerializer.loads(raw)
    except Exception as e:
        raise MalformedResponse(f"undecodable metadata: {type(e).__name__}") from None
    if not isinstance(meta, dict):
        raise MalformedResponse("metadata is not a map")
    if "error" in meta:
        if not isinstance(meta["error"], str):
            raise MalformedResponse("metadata error is not a string")
        return meta
    names, round_id = meta.get("names"), meta.get("round")
    if (not isinstance(names, list) or len(names) > _MAX_NAMES
            or not all(isinstance(n, str) and len(n) <= _MAX_NAME_LEN for n in names)
            or len(set(names)) != len(names)):
        raise MalformedResponse("metadata names are not a list of distinct strings")
    if not isinstance(round_id, int) or isinstance(round_id, bool):
        raise MalformedResponse("metadata round is not an int")
    return meta
