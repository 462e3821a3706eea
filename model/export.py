"""Export a run to a plain transformers folder: `python -m model.export RUN_DIR OUT_DIR`.

Takes the newest complete checkpoint of RUN_DIR, rebuilds the stock `Qwen3MoeForCausalLM` (experts stacked
back into transformers' fused layout, all in fp32) and writes it with `save_pretrained`, together with the
run's tokenizer (saved in RUN_DIR/tokenizer by the training loop). The result loads with
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and needs no code from this project.

OUT_DIR/spes_eval.json records what `python -m peer.eval OUT_DIR` needs to rebuild the run's held-out blocks
(dataset, text field, split, eval fraction, streaming, block length) and the checkpoint's step, so the export
and its run dir give the same held-out loss.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer, Qwen3MoeForCausalLM

from model.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, load_model_state
from model.config import ModelConfig
from model.logfmt import setup_plain_logging
from model.model import SpesMoE, hf_config

logger = logging.getLogger(__name__)

EVAL_INFO_FILE = "spes_eval.json"
EVAL_INFO_FORMAT = "spes-eval-v1"
# The data settings that choose and read the held-out documents (peer/data.py); the shard fields are left out
# on purpose: the eval bucket does not depend on them.
_EVAL_DATA_KEYS = ("dataset", "text_field", "split", "eval_fraction", "streaming")


def to_hf_model(model: SpesMoE) -> Qwen3MoeForCausalLM:
    """A stock transformers model (fp32) holding exactly this model's weights."""
    hf = Qwen3MoeForCausalLM(hf_config(model.cfg))
    state = {}
    for name, tensor in model.lm.state_dict().items():
        if ".mlp.experts." not in name:
            state[name] = tensor.float()
    for layer_idx, bank in enumerate(model.expert_banks()):
        prefix = f"model.layers.{layer_idx}.mlp.experts."
        for tensor_name in ("gate_up_proj", "down_proj"):
            state[prefix + tensor_name] = torch.stack([getattr(slot, tensor_name).detach().float() for slot in bank.bank])
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # rotary inv_freq is a non-persistent buffer; lm_head may be tied to the embeddings.
    missing = [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"export mapping is incomplete: missing={missing[:3]} unexpected={unexpected[:3]}")
    return hf.eval()


def _read_run_yaml(run_dir: Path) -> dict:
    """RUN_DIR/config.yaml as a plain dict (model/ never imports peer/, so no RunConfig here)."""
    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ValueError(f"{path}: cannot read the run's config ({e.strerror})") from None
    except yaml.YAMLError:
        raise ValueError(f"{path}: not valid YAML") from None
    return data if isinstance(data, dict) else {}


def read_model_config(run_dir: Path) -> ModelConfig:
    """ModelConfig from RUN_DIR/config.yaml (the resolved config the peer wrote)."""
    path = run_dir / "config.yaml"
    data = _read_run_yaml(run_dir)
    model_section = data.get("model")
    if not isinstance(model_section, dict):
        raise ValueError(f"{path}: has no 'model' section")
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(model_section) - known)
    if unknown:
        raise ValueError(f"{path}: unknown config key 'model.{unknown[0]}'")
    return ModelConfig(**model_section)


def eval_info(run_dir: Path, seq_len: int, step: int) -> dict:
    """What spes_eval.json holds: the run's held-out data settings, block length and the exported step.

    A local dataset path is stored absolute (resolved from the current directory, as the peer resolved it), so
    the export still finds it from anywhere; "builtin" and hub names are kept as they are."""
    data = _read_run_yaml(run_dir)
    section = data.get("data") if isinstance(data.get("data"), dict) else {}
    settings = {key: section[key] for key in _EVAL_DATA_KEYS if key in section}
    dataset = settings.get("dataset")
    if isinstance(dataset, str) and dataset != "builtin":
        local = Path(dataset).expanduser()
        if local.exists():
            settings["dataset"] = str(local.resolve())
    info = {"format": EVAL_INFO_FORMAT, "step": step, "seq_len": seq_len, "data": settings}
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    batch, batches = train.get("batch_size"), train.get("eval_batches")
    if isinstance(batch, int) and isinstance(batches, int) and batch > 0 and batches > 0:
        info["eval_blocks"] = batch * batches  # the run's eval set (peer/config.py eval_block_count)
    return info


def export_run(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Export the newest checkpoint of `run_dir` to `out_dir`; returns the checkpoint used."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = read_model_config(run_dir)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ValueError(f"{run_dir}: no checkpoint found in {run_dir / 'checkpoints'}")
    tensors, metadata = load_checkpoint(ckpt)
    # Build with every expert frozen in fp32: no optimizer is needed and no precision is lost.
    cfg.frozen_expert_dtype = "float32"
    model = SpesMoE(cfg, owned_experts=())
    load_model_state(model, tensors, str(ckpt))
    hf = to_hf_model(model)
    tok_dir = run_dir / "tokenizer"
    if not tok_dir.is_dir():
        raise ValueError(f"{run_dir}: no tokenizer folder (expected {tok_dir})")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    step = metadata.get("step")
    if not isinstance(step, int):  # older checkpoints: the step is in the file name
        step = int(ckpt.stem.split("_")[-1])
    info = eval_info(run_dir, cfg.seq_len, step)
    (out_dir / EVAL_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    # safetensors writes its files 0600 whatever the umask: an export is for sharing, like the files beside it.
    mode = (out_dir / EVAL_INFO_FILE).stat().st_mode & 0o777
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(mode)
    return ckpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m model.export",
                                     description="Export the newest checkpoint of a run to a transformers folder.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `python -m peer.run`")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (config.json, weights, tokenizer)")
    args = parser.parse_args(argv)
    setup_plain_logging()
    try:
        ckpt = export_run(args.run_dir, args.out_dir)
    except (ValueError, CheckpointError) as e:
        logger.error(f"error: {e}")
        return 2
    logger.info(f"exported {ckpt} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
