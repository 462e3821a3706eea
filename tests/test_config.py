"""Config files and overrides: shipped configs load, small.yaml is the default run, errors name the key."""
from __future__ import annotations

import pytest

from peer.config import ConfigError, RunConfig, load_config, parse_override
from sync.config import parse_expert_list
from tests.conftest import REPO

pytestmark = pytest.mark.unit  # the fast tier: pure decisions, no DHT (python -m pytest -m unit)


@pytest.mark.parametrize("name", ["tiny", "small", "paper-1b"])
def test_shipped_configs_load(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.model.num_experts >= cfg.model.top_k


def test_small_yaml_is_exactly_the_default_run():
    assert load_config(REPO / "configs/small.yaml") == RunConfig()


def test_paper_1b_shape():
    m = load_config(REPO / "configs/paper-1b.yaml").model
    assert (m.d_model, m.n_layers, m.n_heads, m.num_experts, m.top_k, m.expert_hidden, m.seq_len, m.vocab_size) == \
        (768, 12, 12, 16, 2, 2048, 2048, 151665)


def test_overrides_apply_in_order_and_parse_types():
    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override("train.lr=1e-3"), parse_override("model.d_model=128"),
                                                  parse_override("data.streaming=true"), parse_override("train.lr=0.5")])
    assert cfg.train.lr == 0.5 and cfg.model.d_model == 128 and cfg.data.streaming is True


@pytest.mark.parametrize("override, message", [
    ("model.nope=1", "unknown config key 'model.nope'"),
    ("model.d_model=wide", "bad value for model.d_model"),
    ("model.n_heads=5", "divisible"),
    ("model.head_dim=-2", "model.head_dim"),
    ("model.head_dim=15", "must be even"),
    ("sync.compression=zip", "sync.compression"),
    ("train.device=tpu", "train.device"),
    ("sync=3", "expected a mapping"),
    ("sync.protocol=allreduce", "unknown config key 'sync.protocol'"),
    ("sync.wait_for_peers=-1", "sync.wait_for_peers"),
    ("train.own_expert_bias=-1", "train.own_expert_bias "),
    ("train.own_expert_bias=nan", "train.own_expert_bias "),
    ("train.own_expert_bias_decay=0", "train.own_expert_bias_decay"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [parse_override(override)])


def test_expert_lists():
    assert parse_expert_list("0-3,8", 16) == [0, 1, 2, 3, 8]
    assert parse_expert_list("all", 4) == [0, 1, 2, 3]
    assert parse_expert_list("2, 1,1", 4) == [1, 2]
    for bad in ("", "a", "3-1", "0-16", "-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_expert_list(bad, 16)
