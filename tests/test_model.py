"""The ownership-aware MoE model against transformers' stock Qwen3-MoE: forward equality, gradients only for
owned experts, frozen experts bit-identical, run-time ownership changes, parameter counts."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from model.config import ModelConfig
from model.model import SpesMoE, hf_config, lm_loss, router_losses
from peer.config import TrainConfig
from peer.optim import build_optimizer, sync_optimizer_params
from model.export import to_hf_model

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2,
                  expert_hidden=48, seq_len=16)


def _batch(seed: int = 0, batch: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=g)


def _expert_snapshot(model: SpesMoE, expert: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.expert_tensors(expert).items()}


def _train(model: SpesMoE, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        loss, _ = lm_loss(model, _batch(seed + i), 0.001, 0.01)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_same_init_from_same_seed_whatever_the_ownership():
    a = SpesMoE(CFG, owned_experts=[0], seed=3)
    b = SpesMoE(CFG, owned_experts=[1, 2, 3], seed=3)
    c = SpesMoE(CFG, owned_experts=[0], seed=4)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor.float(), b.state_dict()[name].float().to(tensor.dtype).float()) or \
            torch.equal(tensor.to(torch.bfloat16), b.state_dict()[name].to(torch.bfloat16)), name
    assert not torch.equal(a.state_dict()["lm.model.embed_tokens.weight"], c.state_dict()["lm.model.embed_tokens.weight"])


def test_forward_matches_stock_transformers_model():
    cfg = dataclasses.replace(CFG, frozen_expert_dtype="float32")
    ours = SpesMoE(cfg, owned_experts=[0, 2], seed=0).eval()
    stock = to_hf_model(ours)
    assert isinstance(stock, Qwen3MoeForCausalLM)
    x = _batch()[:, :-1]
    with torch.no_grad():
        diff = (ours(x).logits - stock(input_ids=x).logits).abs().max().item()
    assert diff <= 1e-5


def test_only_owned_experts_get_gradients_and_optimizer_state_and_frozen_stay_bit_identical():
    model = SpesMoE(CFG, owned_experts=[1, 3], seed=0)
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2))
    before = {e: _expert_snapshot(model, e) for e in range(CFG.num_experts)}
    loss, _ = lm_loss(model, _batch(), 0.001, 0.01)
    loss.backward()
    for bank in model.expert_banks():
        for idx, slot in enumerate(bank.bank):
            for name in slot.TENSOR_NAMES:
                tensor = getattr(slot, name)
                if idx in (1, 3):
                    assert isinstance(tensor, torch.nn.Parameter) and tensor.grad is not None
                    assert tensor.dtype == torch.float32
                else:
                    assert not tensor.requires_grad and tensor.grad is None and tensor.dtype == torch.bfloat16
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _train(model, optimizer, 4, seed=1)
    state_ids = {id(p) for p in optimizer.state}
    frozen_ids = {id(t) for bank in model.expert_banks() for i, s in enumerate(bank.bank) if i in (0, 2)
                  for t in s.tensors().values()}
    assert not state_ids & frozen_ids
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.requires_grad for p in opt_params)
    assert sum(p.numel() for p in opt_params) == model.num_parameters("trainable")
    for e in range(CFG.num_experts):
        after = model.expert_tensors(e)
        changed = any(not torch.equal(before[e][k], after[k]) for k in after)
        if e in (1, 3):
            assert changed, f"owned expert {e} did not train"
        else:
            assert all(torch.equal(before[e][k], after[k]) for k in after), f"frozen expert {e} changed"


def test_frozen_path_gradients_equal_the_fp32_reference():
    """The custom autograd function for frozen experts gives the same input gradients as plain fp32 math."""
    cfg = dataclasses.replace(CFG, frozen_expert_dtype="float32")
    frozen = SpesMoE(cfg, owned_experts=[], seed=0)
    owned = SpesMoE(cfg, owned_experts=range(cfg.num_experts), seed=0)
    for model in (frozen, owned):
        loss, _ = lm_loss(model, _batch(), 0.001, 0.01)
        loss.backward()
    grads_frozen = dict(frozen.shared_parameters())
    for name, param in owned.shared_parameters():
        torch.testing.assert_close(grads_frozen[name].grad, param.grad, rtol=1e-4, atol=1e-6)



def test_bf16_frozen_weights_of_one_shape_each_keep_their_own_values_forward_and_backward():
    """Frozen bf16 weights are upcast into one reused CPU buffer per shape: two weights of the same shape in one
    graph still give the plain fp32 results, outputs and input gradients alike."""
    from model.experts import frozen_linear

    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(24, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    x = torch.randn(5, 16, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = frozen_linear(x, w1) * frozen_linear(x, w2)
    y_ref = (x_ref @ w1.float().T) * (x_ref @ w2.float().T)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)

def test_ownership_switch_at_run_time():
    model = SpesMoE(CFG, owned_experts=[0], seed=0)
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2))
    _train(model, optimizer, 2)
    trained_0 = _expert_snapshot(model, 0)
    values_1 = _expert_snapshot(model, 1)

    model.set_owned_experts([1])
    sync_optimizer_params(optimizer, model)
    # Values are kept across the switch: 0 is rounded to its frozen dtype, 1 is upcast exactly.
    for k, v in model.expert_tensors(0).items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, trained_0[k].to(torch.bfloat16))
    for k, v in model.expert_tensors(1).items():
        assert v.dtype == torch.float32 and torch.equal(v, values_1[k].float())
    assert all(bank.bank[1].gate_up_proj.requires_grad and not bank.bank[0].gate_up_proj.requires_grad
               for bank in model.expert_banks())
    opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in model.parameters() if p.requires_grad}
    assert all(id(p) in opt_params for p in optimizer.state)

    frozen_0 = _expert_snapshot(model, 0)
    _train(model, optimizer, 3, seed=5)
    assert all(torch.equal(frozen_0[k], v) for k, v in model.expert_tensors(0).items())
    assert any(not torch.equal(values_1[k].float(), v) for k, v in model.expert_tensors(1).items())


def test_parameter_counts_match_the_real_modules():
    model = SpesMoE(CFG, owned_experts=[0, 1], seed=0)
    stock = Qwen3MoeForCausalLM(hf_config(CFG))
    assert model.num_parameters("total") == sum(p.numel() for p in stock.parameters())
    assert model.num_parameters("trainable") == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # active = everything but the experts a token does not visit
    per_layer_experts = stock.model.layers[0].mlp.experts
    per_expert = (per_layer_experts.gate_up_proj[0].numel() + per_layer_experts.down_proj[0].numel()) * CFG.n_layers
    assert model.num_parameters("active") == model.num_parameters("total") - per_expert * (CFG.num_experts - CFG.top_k)
    tied = SpesMoE(dataclasses.replace(CFG, tie_embeddings=True), owned_experts=[0], seed=0)
    stock_tied = Qwen3MoeForCausalLM(hf_config(dataclasses.replace(CFG, tie_embeddings=True)))
    assert tied.num_parameters("total") == sum(p.numel() for p in stock_tied.parameters())


def test_router_losses_balanced_and_unbalanced():
    uniform = (torch.zeros(64, 4),)
    z, lb = router_losses(uniform, top_k=2)
    assert z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-5)
    assert lb.item() == pytest.approx(1.0, rel=1e-5)
    skewed = torch.zeros(64, 4)
    skewed[:, 0] = 5.0
    skewed[:, 1] = 4.0
    _, lb_skewed = router_losses((skewed,), top_k=2)
    assert lb_skewed.item() > 1.5


def test_bad_ownership_is_rejected():
    with pytest.raises(ValueError, match="out of range"):
        SpesMoE(CFG, owned_experts=[7])


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = SpesMoE(CFG, owned_experts=[0, 1], seed=0).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        loss, _ = lm_loss(model, _batch(), 0.001, 0.01)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-6)


def test_decayed_load_balance_scale_and_effect():
    from model.model import decayed_lb_scale
    scale = decayed_lb_scale(0, 1000, owned=[1, 3], num_experts=4)
    assert scale.tolist() == pytest.approx([1.0, 0.7, 1.0, 0.7])
    assert decayed_lb_scale(100, 1000, [1], 4)[1].item() == pytest.approx(0.85)
    assert decayed_lb_scale(200, 1000, [1], 4)[1].item() == pytest.approx(1.0)
    assert decayed_lb_scale(900, 1000, [1], 4)[1].item() == pytest.approx(1.0)
    # Routing that favours the own experts is penalized less than without the scale.
    logits = torch.zeros(64, 4)
    logits[:, 1] = 2.0
    logits[:, 3] = 1.5
    _, lb_plain = router_losses((logits,), top_k=2)
    _, lb_scaled = router_losses((logits,), top_k=2, count_scale_E=decayed_lb_scale(0, 1000, [1, 3], 4))
    assert lb_scaled.item() < lb_plain.item()


def _expert_counts(model: SpesMoE, x: torch.Tensor) -> torch.Tensor:
    """Tokens each expert of layer 0 receives (its router's top-k choice) on input x."""
    chosen = []
    handle = model.lm.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    try:
        model(x)
    finally:
        handle.remove()
    return torch.bincount(chosen[0].reshape(-1), minlength=CFG.num_experts)


def test_own_expert_bias_steers_training_tokens_only():
    from peer.optim import own_expert_bias_at

    x = _batch(batch=8)[:, :-1]
    model = SpesMoE(CFG, owned_experts=[1], seed=0)
    stock = SpesMoE(CFG, owned_experts=[1], seed=0)
    # The router's weights are transformers' own initialization, unchanged by the biased router.
    assert torch.equal(model.lm.model.layers[0].mlp.gate.weight, stock.lm.model.layers[0].mlp.gate.weight)
    model.train()
    plain = _expert_counts(model, x)
    model.set_own_expert_bias(3.0)
    biased = _expert_counts(model, x)
    assert biased[1] == x.numel() and biased[1] > plain[1]     # every token now also goes to the owned expert
    assert biased.sum() == plain.sum()                          # still top-k per token
    # The outputs are weighted by the unbiased probabilities and the losses see the unbiased logits.
    out = model(x)
    probs = out.router_logits[0].float().softmax(-1)
    assert torch.allclose(out.router_logits[0], stock(x).router_logits[0])
    assert (probs[:, 1] < 0.5).all()
    # Eval mode, zero bias, checkpoints and ownership changes: the stock routing, nothing saved.
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, stock.eval()(x).logits)
    assert set(model.state_dict()) == set(stock.state_dict())
    model.set_owned_experts([2, 3])
    assert model.lm.model.layers[1].mlp.gate.select_bias_E.tolist() == [0.0, 0.0, 3.0, 3.0]
    model.set_own_expert_bias(0.0)
    model.train()
    assert torch.equal(_expert_counts(model, x), plain)
    cfg = TrainConfig(own_expert_bias=2.0, own_expert_bias_decay=0.5, max_steps=100)
    assert [own_expert_bias_at(s, cfg) for s in (0, 25, 50, 90)] == pytest.approx([2.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("owned, frozen_dtype", [({1, 2}, "float32"), ({0, 1, 2, 3}, "float32"), (set(), "float32"),
                                                 ({3}, "bfloat16")])
def test_grouped_experts_equal_the_loop_forward_and_gradients(owned, frozen_dtype):
    cfg = dataclasses.replace(CFG, frozen_expert_dtype=frozen_dtype)
    models = {}
    for kernel in ("loop", "grouped"):
        model = SpesMoE(dataclasses.replace(cfg, expert_kernel=kernel), owned_experts=owned)
        assert model.use_expert_kernel(torch.device("cpu")) == kernel
        loss, _ = lm_loss(model, _batch(), z_coef=1e-3, lb_coef=1e-2)
        loss.backward()
        models[kernel] = (model, loss.detach())
    (loop, loss_loop), (grouped, loss_grouped) = models["loop"], models["grouped"]
    torch.testing.assert_close(loss_grouped, loss_loop, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in loop.named_parameters()}
    for name, param in grouped.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # Frozen experts stay without gradients and optimizer state on the grouped path too.
    assert sum(p.requires_grad for p in grouped.parameters()) == sum(p.requires_grad for p in loop.parameters())


def test_auto_expert_kernel_is_the_loop_on_cpu():
    model = SpesMoE(dataclasses.replace(CFG, expert_kernel="auto"))
    assert model.use_expert_kernel(torch.device("cpu")) == "loop"
    assert not any(bank.grouped for bank in model.expert_banks())


def test_grouped_experts_leave_an_owned_expert_without_tokens_without_a_gradient():
    """As in the loop, an owned expert no token chose gets no gradient (None), so AdamW does not move it."""
    for kernel in ("loop", "grouped"):
        model = SpesMoE(dataclasses.replace(CFG, expert_kernel=kernel), owned_experts={0, 1})
        bank = model.expert_banks()[0]
        x_TD = torch.randn(6, CFG.d_model, requires_grad=True)
        chosen_TK = torch.tensor([[0, 2], [2, 3], [0, 3], [3, 2], [0, 2], [2, 0]])  # expert 1 never
        bank(x_TD, chosen_TK, torch.full((6, 2), 0.5)).sum().backward()
        assert bank.bank[1].gate_up_proj.grad is None and bank.bank[0].gate_up_proj.grad is not None, kernel
