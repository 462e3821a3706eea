"""Bytes per contribution at the paper-1b shape for each codec method of sync/sparse.py, and its cost and error.

    python -m bench.contrib_bytes                 # paper-1b (configs/paper-1b.yaml)
    python -m bench.contrib_bytes --shape tiny    # seconds: smoke run of the same code

Table 1 (sizes) uses `sync.sparse.encoded_size` on the real parameter shapes, taken from the project's model
(`model.model.SpesMoE`) built on the meta device (no memory, so 1B parameters are never allocated): the shared
tensors (`shared_parameters()`) and one expert's tensors (`expert_tensors(e)`, the same shapes for every e).
A contribution is the shared tensors plus the experts a peer owns (`sync.experts_per_peer` of the config).
Header bytes are included. Ratios are vs fp32 (`sync.compression: none`, uncompressed contributions); bits/param =
8 · blob bytes / parameters in the contribution.

Table 2 (bytes per peer per round, 4 and 16 peers) follows from the blob sizes: every peer fetches every other
peer's blob, 2 (N-1) blobs sent + received per peer. Each codec is compared with uncompressed contributions and
with a reference computed from the shapes: an fp32 butterfly all-reduce of the shared tensors plus bf16 expert
copies from owners (the round protocol before contributions).

Table 3 (cost) encodes and decodes real random Gaussian tensors of one expert's shapes (and, separately, of the
largest shared tensor, the embedding) on this machine's CPU and reports wall time and the relative
reconstruction error ||x - decoded|| / ||x|| (for sparse this is dominated by the dropped entries, which error
feedback sends later, not by quantization); "sent-entry error" is the same over the entries that were sent.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from bench.common import config_path, format_table, get_logger, set_threads, setup_logging
from sync.sparse import METHODS, SparseSpec, decode, encode, encoded_size

logger = get_logger(__name__)


def model_shapes(shape: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], int]:
    """(shared shapes, one expert's shapes, experts per peer) of a named config, from SpesMoE on meta."""
    from model.model import SpesMoE
    from peer.config import load_config

    cfg = load_config(config_path(shape))
    with torch.device("meta"):
        model = SpesMoE(cfg.model)
    shared = {name: tuple(p.shape) for name, p in model.shared_parameters()}
    expert = {name: tuple(t.shape) for name, t in model.expert_tensors(0).items()}
    per_peer = cfg.sync.experts_per_peer or cfg.model.num_experts
    return shared, expert, int(per_peer)


def specs() -> dict[str, SparseSpec]:
    out = {m: SparseSpec(method=m) for m in METHODS if m != "sparse"}
    out["sparse"] = SparseSpec()
    out["sparse 4-bit"] = SparseSpec(bits=4)
    return out


def size_table(shared: dict, expert: dict, per_peer: int) -> str:
    rows, base = [], None
    params = sum(map(math.prod, shared.values())) + per_peer * sum(map(math.prod, expert.values()))
    for label, spec in specs().items():
        s, e = encoded_size(shared, spec), encoded_size(expert, spec)
        contribution = encoded_size({**shared, **{f"e{i}.{n}": v for i in range(per_peer) for n, v in expert.items()}},
                                    spec)
        base = base or contribution
        rows.append([label, f"{s / 1e6:.2f}", f"{e / 1e6:.2f}", f"{contribution / 1e6:.2f}",
                     f"{8 * contribution / params:.3f}", f"{contribution / base:.4f}", f"{base / contribution:.1f}x"])
    return format_table(["method", "shared MB", "one expert MB", f"shared + {per_peer} experts MB",
                         "bits/param", "ratio vs fp32", "reduction"], rows)


def per_peer_table(shared: dict, expert: dict, per_peer: int, num_experts: int, peers: list[int]) -> str:
    """Bytes one peer sends + receives per round, on average over the peers: every peer fetches every other
    peer's blob (each byte a peer receives another sends, so the average sent equals the average received,
    whoever serves a passed-on blob): 2 (N-1) blobs. Each codec against uncompressed (fp32) contributions, and
    against a computed reference: the fp32 butterfly all-reduce of the shared tensors (4 (N-1)/N copies) plus
    bf16 expert copies owner to non-owner (2 (N-1)/N copies of every expert), the round protocol before
    contributions. Each of the N peers owns `per_peer` experts."""
    shared_numel = sum(map(math.prod, shared.values()))
    expert_numel = num_experts * sum(map(math.prod, expert.values()))
    params = shared_numel + per_peer * sum(map(math.prod, expert.values()))
    contribution = {**shared, **{f"e{i}.{k}": v for i in range(per_peer) for k, v in expert.items()}}
    codecs = {**specs(), **{f"sparse top-{k}": SparseSpec(topk=k) for k in (16, 128, 256)}}
    rows = []
    for n in peers:
        fp32 = 2 * (n - 1) * encoded_size(contribution, SparseSpec(method="fp32"))
        allreduce = (n - 1) / n * (4 * 4 * shared_numel + 2 * 2 * expert_numel)
        for label, spec in codecs.items():
            blob = encoded_size(contribution, spec)
            moved = 2 * (n - 1) * blob
            rows.append([str(n), label, f"{blob / 1e6:.2f}", f"{8 * blob / params:.3f}", f"{moved / 1e9:.3f}",
                         f"{fp32 / moved:.1f}x", f"{allreduce / 1e9:.2f}", f"{allreduce / moved:.1f}x"])
    return format_table(["peers", "codec", "blob MB", "bits/param", "GB/peer/round", "reduction vs fp32",
                         "all-reduce reference GB", "reduction vs it"], rows)


def cost_table(expert: dict, embedding: tuple[int, ...]) -> str:
    gen = torch.Generator().manual_seed(0)
    cases = {"one expert": {n: torch.randn(s, generator=gen) for n, s in expert.items()},
             "embedding": {"embed": torch.randn(embedding, generator=gen)}}
    rows = []
    for case, tensors in cases.items():
        numel = sum(t.numel() for t in tensors.values())
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        for label, spec in specs().items():
            t0 = time.perf_counter()
            blob, decoded = encode(tensors, spec)
            t1 = time.perf_counter()
            out = decode(blob, shapes, max_bytes=encoded_size(shapes, spec))
            t2 = time.perf_counter()
            exact = all(torch.equal(out[n], decoded[n]) for n in tensors)
            err = math.sqrt(sum(float((tensors[n] - out[n]).pow(2).sum()) for n in tensors)
                            / sum(float(t.pow(2).sum()) for t in tensors.values()))
            # quantization alone: error over the entries that were sent (all of them for dense methods)
            num = den = 0.0
            for n, t in tensors.items():
                sent = out[n] != 0
                num += float((t[sent] - out[n][sent]).pow(2).sum())
                den += float(t[sent].pow(2).sum())
            rows.append([case, f"{numel / 1e6:.1f}M", label, f"{len(blob) / 1e6:.2f}", f"{t1 - t0:.2f}",
                         f"{t2 - t1:.2f}", f"{err:.4f}", f"{math.sqrt(num / den):.4f}", "yes" if exact else "NO"])
            del blob, decoded, out
    return format_table(["tensors", "elements", "method", "MB", "encode s", "decode s", "rel. error",
                         "sent-entry error", "decoded == encode's"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="paper-1b", help="config name: paper-1b, small, tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = one per core)")
    parser.add_argument("--no-cost", action="store_true", help="sizes only (no tensors allocated)")
    args = parser.parse_args(argv)
    setup_logging()
    threads = set_threads(args.threads)
    shared, expert, per_peer = model_shapes(args.shape)
    logger.info(f"{args.shape}: {len(shared)} shared tensors ({sum(map(math.prod, shared.values())) / 1e6:.1f}M), "
                f"{len(expert)} tensors per expert ({sum(map(math.prod, expert.values())) / 1e6:.1f}M)")
    print(f"## Bytes per contribution, {args.shape} (default SparseSpec: chunk 4096, top-64, 2 bits)\n")
    print(size_table(shared, expert, per_peer))
    from peer.config import load_config
    num_experts = load_config(config_path(args.shape)).model.num_experts
    print(f"\n## Bytes per peer per round (sent + received), {args.shape}, each peer owning {per_peer} experts\n")
    print(per_peer_table(shared, expert, per_peer, num_experts, [4, 16]))
    if not args.no_cost:
        embedding = max(shared.values(), key=math.prod)
        print(f"\n## Encode/decode on random Gaussian tensors ({threads} CPU thread(s))\n")
        print(cost_table(expert, embedding))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
