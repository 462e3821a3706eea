"""Upcycling a dense transformers Qwen3 (built here, no downloads) into a SPES MoE run (model/upcycle.py):
at noise 0 the MoE computes the dense model's logits, noise makes every expert differ on about half its
weights, `peer.run --init-from` starts training from the upcycled weights, and bad input is a one-line error."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

from model.checkpoint import CheckpointError, load_model_state
from model.export import to_hf_model
from model.model import SpesMoE
from model.upcycle import INIT_FILE, read_init, upcycle
from peer.config import load_config, parse_override
from peer.tokenizer import build_tokenizer
from peer.train import Trainer
from tests.conftest import REPO, peer_cmd

# head_dim 32 with d 64 and 4 heads: a dense Qwen3 whose heads are not d_model / n_heads wide (as Qwen3-0.6B's).
DENSE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False)


def _dense(tmp_path: Path, **over) -> tuple[Path, Qwen3ForCausalLM]:
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(**{**DENSE, **over})).eval()
    out = tmp_path / "dense"
    model.save_pretrained(str(out))
    build_tokenizer("builtin").save_pretrained(str(out))
    return out, model


def _moe(out_dir: Path) -> SpesMoE:
    cfg = load_config(out_dir / "config.yaml", [])
    model = SpesMoE(cfg.model, owned_experts=range(cfg.model.num_experts), seed=cfg.train.seed)
    load_model_state(model, read_init(out_dir, cfg.model), str(out_dir / INIT_FILE))
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_upcycled_model_equals_the_dense_one_at_noise_zero(tmp_path, tied):
    dense_dir, dense = _dense(tmp_path, tie_word_embeddings=tied)
    out = upcycle(dense_dir, tmp_path / "moe", num_experts=4, top_k=2, noise_std=0.0, seq_len=64)
    moe = _moe(out)
    assert moe.cfg.norm_topk_prob and moe.cfg.head_dim == 32 and moe.cfg.expert_hidden == 96
    ids_BT = torch.randint(0, DENSE["vocab_size"], (2, 48))
    with torch.no_grad():
        want_BTV = dense(input_ids=ids_BT).logits
        got_BTV = moe(ids_BT).logits
        exported_BTV = to_hf_model(moe)(input_ids=ids_BT).logits
    torch.testing.assert_close(got_BTV, want_BTV, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exported_BTV, want_BTV, rtol=1e-5, atol=1e-5)
    # The new router really spreads tokens over the experts: equality is not one expert doing all the work.
    chosen = moe.lm.model.layers[0].mlp.gate(moe.lm.model.embed_tokens(ids_BT))[2]
    assert len(chosen.unique()) == 4


def test_noise_makes_every_expert_differ_on_a_random_half(tmp_path):
    dense_dir, dense = _dense(tmp_path)
    moe = _moe(upcycle(dense_dir, tmp_path / "moe", num_experts=4, top_k=2, noise_std=0.02, seq_len=64))
    mlp = dense.model.layers[1].mlp
    gate_up_2FD = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    experts = [slot.gate_up_proj.detach() for slot in moe.expert_banks()[1].bank]
    for i, w in enumerate(experts):
        changed = (w != gate_up_2FD).float().mean().item()
        assert 0.45 < changed < 0.55, changed
        noise = (w - gate_up_2FD)[w != gate_up_2FD]
        assert 0.015 < noise.std().item() < 0.025
        for other in experts[i + 1:]:
            assert not torch.equal(w, other)


def test_peer_run_starts_from_the_upcycled_weights(tmp_path):
    dense_dir, dense = _dense(tmp_path)
    out = upcycle(dense_dir, tmp_path / "moe", num_experts=4, top_k=2, noise_std=0.0, seq_len=64)
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["tokenizer"] == str((out / "tokenizer").resolve())
    small = ["train.batch_size=2", "train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=2",
             "model.frozen_expert_dtype=float32", "sync.experts=0-1"]
    cfg = load_config(out / "config.yaml", [parse_override(s) for s in
                                            [f"run_dir={tmp_path / 'run'}", f"train.init_from={out}", *small]])
    trainer = Trainer(cfg)
    ids_BT = torch.randint(0, DENSE["vocab_size"], (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(ids_BT).logits, dense(input_ids=ids_BT).logits,
                                   rtol=1e-5, atol=1e-5)
    # And as users start it: the command line, then a resume that must not re-apply the init.
    cmd = peer_cmd("--config", str(out / "config.yaml"), "--init-from", str(out), "--run-dir", str(tmp_path / "cli"),
                   "--sync-every", "0", *[a for s in small for a in ("--set", s)])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialized from" in proc.stderr
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "initialized from" not in proc.stderr, proc.stderr[-2000:]


def test_bad_input_is_one_line(tmp_path):
    not_qwen3 = tmp_path / "llama"
    not_qwen3.mkdir()
    (not_qwen3 / "config.json").write_text('{"model_type": "llama"}')
    proc = subprocess.run(["python", "-m", "model.upcycle", str(not_qwen3), str(tmp_path / "o")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run(peer_cmd("--config", "configs/tiny.yaml", "--init-from", str(tmp_path), "--sync-every", "0",
                                   "--run-dir", str(tmp_path / "run")), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no init.safetensors" in proc.stderr and "Traceback" not in proc.stderr
    dense_dir, _ = _dense(tmp_path)
    out = upcycle(dense_dir, tmp_path / "moe", num_experts=4, top_k=2, noise_std=0.0, seq_len=64)
    other = load_config(out / "config.yaml", [parse_override("model.num_experts=8")]).model
    with pytest.raises(CheckpointError, match="num_experts"):
        read_init(out, other)
    (out / INIT_FILE).write_bytes((out / INIT_FILE).read_bytes()[:200])  # a copy cut short
    with pytest.raises(CheckpointError, match="corrupt init file"):
        read_init(out, load_config(out / "config.yaml", []).model)
