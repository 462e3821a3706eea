"""`python -m peer.eval RUN_DIR_OR_EXPORT`: held-out loss and perplexity of a run's newest checkpoint or of its export.

The argument is either a run dir (config.yaml + checkpoints/, as `python -m peer.run` writes it) or an export
(config.json + spes_eval.json, as `python -m model.export` writes it). Both are scored on the same blocks: the
first `--max-blocks` blocks of the run's held-out documents (peer/data.py `build_eval_blocks`, identical on every
peer), so a run dir and its export give the same loss (SPEC 3a). The loss is the mean next-token cross-entropy
over all predicted tokens; perplexity = exp(loss). The result line goes to stdout (scripts read it), logs to
stderr.

`--write-lm-eval-task DIR` also writes an lm-evaluation-harness task folder over the same held-out documents, so
`lm_eval --model hf --model_args pretrained=EXPORT,max_length=SEQ_LEN --tasks spes_heldout --include_path DIR`
scores the export fully offline (word/byte perplexity, bits per byte).

Exit codes: 0 with a result; 2 with a one-line error naming the cause for bad input (missing dir, no checkpoint,
corrupt file, bad flag, unreadable dataset).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peer.cli import OneLineParser

# A plain logger: peer.logs.setup_logging routes it through hivemind's handler (one format with peer.run), and
# importing hivemind here would cost seconds before a bad path could be reported.
logger = logging.getLogger(__name__)

TASK_NAME = "spes_heldout"
EVAL_INFO_FILE = "spes_eval.json"  # = model.export.EVAL_INFO_FILE; not imported: bad flags must fail before torch


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m peer.eval", description="Held-out loss and perplexity of a run dir (its newest "
                "complete checkpoint) or of a folder written by python -m model.export.")
    p.add_argument("path", metavar="RUN_DIR_OR_EXPORT", help="run dir (config.yaml, checkpoints/) or export folder "
                   "(config.json, spes_eval.json)")
    p.add_argument("--dataset", metavar="NAME_OR_PATH", help="evaluate on this dataset's held-out documents instead "
                   "of the run's (required for an export without spes_eval.json)")
    p.add_argument("--text-field", metavar="NAME", help="text column of --dataset (default: the run's, else 'text')")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="tokenizer name/path or builtin (default: the one "
                   "saved with the run or the export)")
    p.add_argument("--seq-len", type=_positive, metavar="N", help="block length in tokens (default: the run's "
                   "model.seq_len, recorded in the export)")
    p.add_argument("--max-blocks", type=_positive, metavar="N", help="held-out blocks to score (default: the run's "
                   "eval set, train.eval_batches x train.batch_size blocks, as the training loop scores)")
    p.add_argument("--batch-size", type=_positive, default=8, metavar="N", help="blocks per forward pass (default: 8)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run the model (default: auto, a GPU if there is one)")
    p.add_argument("--json", metavar="FILE", help="also write the result as a JSON object to FILE")
    p.add_argument("--write-lm-eval-task", metavar="DIR", help=f"also write an lm-evaluation-harness task "
                   f"'{TASK_NAME}' (YAML + JSONL of the held-out documents) to DIR, for lm_eval --include_path DIR")
    return p


@dataclass
class Target:
    """What is scored: a forward function (token ids -> logits) with its tokenizer and held-out settings."""

    kind: str  # "run dir" | "export"
    forward: Callable[[Any], Any]
    vocab_size: int
    tokenizer: Any
    data: Any  # peer.config.DataConfig
    seq_len: int
    step: int | None
    eval_blocks: int = 64  # the run's eval set size (peer.config.eval_block_count), --max-blocks' default


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _tokenizer(name: str | None, saved: Path, where: str) -> Any:
    """--tokenizer if given, else the tokenizer folder saved with the run or the export."""
    from peer.tokenizer import build_tokenizer
    if name is not None:
        return build_tokenizer(name)
    if not saved.is_dir():
        raise ValueError(f"{where} has no saved tokenizer (expected it in {saved}); pass --tokenizer")
    return build_tokenizer(str(saved))


def _data_config(settings: dict[str, Any], args: argparse.Namespace, where: str) -> Any:
    """DataConfig from recorded settings with --dataset/--text-field on top; ValueError naming the bad field."""
    from peer.config import DataConfig
    known = {f.name for f in dataclasses.fields(DataConfig)}
    cfg = DataConfig(**{k: v for k, v in settings.items() if k in known})
    if args.dataset is not None:
        cfg.dataset = args.dataset
    if args.text_field is not None:
        cfg.text_field = args.text_field
    # A hand-edited spes_eval.json must fail here, naming the field, not deep inside `datasets`.
    for name in ("dataset", "text_field", "split"):
        if not isinstance(getattr(cfg, name), str):
            raise ValueError(f"{where}: data.{name} must be a string, got {getattr(cfg, name)!r}")
    if cfg.streaming is not None and not isinstance(cfg.streaming, bool):
        raise ValueError(f"{where}: data.streaming must be true, false or null, got {cfg.streaming!r}")
    if isinstance(cfg.eval_fraction, bool) or not isinstance(cfg.eval_fraction, (int, float)):
        raise ValueError(f"{where}: data.eval_fraction must be a number, got {cfg.eval_fraction!r}")
    cfg.validate()
    return cfg


def _device(name: str) -> Any:
    import torch
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def load_run_dir(run_dir: Path, args: argparse.Namespace) -> Target:
    """The run's newest checkpoint that reads completely, in SpesMoE with every expert frozen in fp32 (as export)."""
    from model.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, load_model_state
    from model.model import SpesMoE
    from peer.config import eval_block_count, load_config
    cfg = load_config(run_dir / "config.yaml")
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ValueError(f"{run_dir}: no checkpoint found in {run_dir / 'checkpoints'}")
    errors: list[CheckpointError] = []
    # Newest first, like a resuming peer, but read-only: a damaged file is named and skipped, never renamed,
    # since a live peer may own this run dir.
    for step, path in reversed(found):
        try:
            tensors, meta = load_checkpoint(path)
            break
        except CheckpointError as e:
            errors.append(e)
    else:
        raise errors[0]
    for e in errors:
        logger.warning(f"{e}; using the previous complete checkpoint {path.name}")
    cfg.model.frozen_expert_dtype = "float32"  # nothing is trained, so keep every expert at full precision
    model = SpesMoE(cfg.model, owned_experts=())
    load_model_state(model, tensors, str(path))
    device = _device(args.device)
    model = model.to(device).eval()
    meta_step = meta.get("step")
    return Target(kind="run dir", forward=lambda ids: model(ids.to(device)).logits, vocab_size=cfg.model.vocab_size,
                  tokenizer=_tokenizer(args.tokenizer, run_dir / "tokenizer", str(run_dir)),
                  data=_data_config(dataclasses.asdict(cfg.data), args, str(run_dir / "config.yaml")),
                  seq_len=args.seq_len or cfg.model.seq_len, step=meta_step if isinstance(meta_step, int) else step,
                  eval_blocks=eval_block_count(cfg.train))


def load_export(export_dir: Path, args: argparse.Namespace) -> Target:
    """A transformers folder (stock Qwen3MoeForCausalLM, fp32) with the held-out settings export recorded."""
    info_path = export_dir / EVAL_INFO_FILE
    info: dict[str, Any] = {}
    if info_path.exists():
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{info_path}: corrupt ({_first_line(e)})") from None
        if not isinstance(info, dict) or not isinstance(info.get("data", {}), dict):
            raise ValueError(f"{info_path}: corrupt (not the object python -m model.export writes)")
    elif args.dataset is None:
        raise ValueError(f"{export_dir} has no {EVAL_INFO_FILE} (exported by an older model.export?): pass --dataset "
                         f"(and --seq-len) to say what to evaluate on")
    seq_len = args.seq_len or info.get("seq_len") or 256
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"{info_path}: corrupt (seq_len {seq_len!r})")
    import torch
    from transformers import AutoModelForCausalLM
    try:
        # fp32 whatever config.json says: the run dir path computes in fp32 too.
        model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)
    except Exception as e:  # transformers raises OSError, ValueError, safetensors errors, ... for a bad folder
        raise ValueError(f"cannot load the exported model in {export_dir}: {_first_line(e)}") from None
    device = _device(args.device)
    model = model.to(device).eval()
    step = info.get("step")
    return Target(kind="export", forward=lambda ids: model(input_ids=ids.to(device)).logits,
                  vocab_size=model.config.vocab_size, tokenizer=_tokenizer(args.tokenizer, export_dir, str(export_dir)),
                  data=_data_config(info.get("data", {}), args, str(info_path)), seq_len=seq_len,
                  step=step if isinstance(step, int) else None, **({"eval_blocks": blocks} if isinstance(
                      blocks := info.get("eval_blocks"), int) and 0 < blocks <= 1_000_000 else {}))


def heldout_loss(forward: Callable[[Any], Any], blocks: Any, batch_size: int) -> float:
    """Mean next-token cross-entropy over every predicted token of `blocks` ([N, seq_len + 1] token ids)."""
    import torch
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start:start + batch_size]
            logits = forward(batch[:, :-1]).float()
            targets = batch[:, 1:].to(logits.device)
            # Summed per batch and divided once: weights every token equally, whatever the last batch's size.
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.reshape(-1),
                                                       reduction="sum").double().item()
            count += targets.numel()
    return total / count


def write_lm_eval_task(out_dir: Path, data: Any, tokenizer: Any, max_tokens: int, note: str) -> tuple[Path, int]:
    """An lm-evaluation-harness task folder: TASK_NAME.yaml + TASK_NAME.jsonl ({"text": document} per line).

    The documents are the run's held-out documents in dataset order, as many as the eval blocks are cut from
    (until they hold `max_tokens` tokens, end-of-text included), so lm_eval scores the same text as peer.eval,
    only per document and by its own rolling windows. Returns (yaml path, documents written)."""
    import yaml

    from peer.data import heldout_documents
    out_dir.mkdir(parents=True, exist_ok=True)
    docs_path = (out_dir / f"{TASK_NAME}.jsonl").resolve()
    written, tokens = 0, 0
    with open(docs_path, "w", encoding="utf-8") as f:
        for text in heldout_documents(data):
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            written += 1
            tokens += len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) + 1
            if tokens >= max_tokens:
                break
    task = {
        "task": TASK_NAME,
        # The `datasets` json builder on a local file (absolute: lm_eval may run from anywhere): no hub access.
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(docs_path)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        # A column name, not a template: lm_eval then passes the document through untouched.
        "doc_to_target": "text",
        # Aggregations named (as lm_eval's defaults for these metrics) so it does not warn about each one.
        "metric_list": [{"metric": metric, "aggregation": aggregation, "higher_is_better": False}
                        for metric, aggregation in (("word_perplexity", "weighted_perplexity"),
                                                    ("byte_perplexity", "weighted_perplexity"),
                                                    ("bits_per_byte", "bits_per_byte"))],
        "metadata": {"version": 1.0},
    }
    yaml_path = out_dir / f"{TASK_NAME}.yaml"
    header = "".join(f"# {line}\n" for line in note.splitlines())
    yaml_path.write_text(header + yaml.safe_dump(task, sort_keys=False, allow_unicode=True))
    return yaml_path, written


def evaluate(target: Target, max_blocks: int, batch_size: int) -> tuple[float, int]:
    """(held-out loss, blocks scored) of `target` on its run's first `max_blocks` held-out blocks."""
    from peer.data import build_eval_blocks
    if len(target.tokenizer) > target.vocab_size:
        raise ValueError(f"the tokenizer has {len(target.tokenizer)} tokens but the model only {target.vocab_size}")
    blocks = build_eval_blocks(target.data, target.tokenizer, target.seq_len, max_blocks)
    return heldout_loss(target.forward, blocks, batch_size), len(blocks)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    path = Path(args.path)
    # A wrong path is a bad argument: said at once, in argparse's one line, before any heavy import.
    if not path.is_dir():
        parser.error(f"{path} does not exist" if not path.exists() else f"{path} is not a directory")
    from peer.logs import setup_logging  # imports hivemind, transformers, datasets
    setup_logging()
    try:
        from model.checkpoint import CheckpointError
        from peer.config import ConfigError
        try:
            if (path / "config.yaml").is_file():
                target = load_run_dir(path, args)
            elif (path / "config.json").is_file():
                target = load_export(path, args)
            else:
                raise ValueError(f"{path} is neither a run dir (no config.yaml) nor an export (no config.json)")
            loss, n_blocks = evaluate(target, args.max_blocks or target.eval_blocks, args.batch_size)
        except (CheckpointError, ConfigError) as e:
            raise ValueError(str(e)) from None
        perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
        step = "unknown" if target.step is None else target.step
        print(f"held-out loss {loss:.4f}  perplexity {perplexity:.2f}  ({n_blocks} blocks x {target.seq_len} "
              f"tokens, dataset {target.data.dataset}, step {step})", flush=True)
        result = {"loss": loss, "perplexity": perplexity, "blocks": n_blocks, "seq_len": target.seq_len,
                  "tokens": n_blocks * target.seq_len, "dataset": target.data.dataset, "step": target.step,
                  "source": target.kind, "path": str(path)}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if args.write_lm_eval_task:
            # max_length: lm_eval's default window is the model's max_position_embeddings (>= 2048), far past the
            # block length the run trained on.
            note = (f"lm-evaluation-harness task written by python -m peer.eval {path}\n"
                    f"{TASK_NAME}.jsonl: the held-out documents of dataset {target.data.dataset} that peer.eval's "
                    f"{n_blocks} blocks come from\n"
                    f"lm_eval --model hf --model_args pretrained=EXPORT_DIR,max_length={target.seq_len} "
                    f"--tasks {TASK_NAME} --include_path THIS_DIR")
            yaml_path, docs = write_lm_eval_task(Path(args.write_lm_eval_task), target.data, target.tokenizer,
                                                 n_blocks * (target.seq_len + 1), note)
            logger.info(f"wrote lm-eval task {TASK_NAME} ({docs} held-out documents) to {yaml_path.parent}; run "
                        f"lm_eval --model hf --model_args pretrained=EXPORT_DIR,max_length={target.seq_len} "
                        f"--tasks {TASK_NAME} --include_path {yaml_path.parent}")
    except (ValueError, OSError) as e:
        logger.error(f"error: {_first_line(e)}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
