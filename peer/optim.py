"""Local optimizer for one peer: AdamW over trainable parameters only, warm-up + cosine schedule.

Frozen (non-owned) experts are buffers, so they can never reach the optimizer. When ownership changes at run
time the set of trainable tensors changes too; `sync_optimizer_params` drops the state of tensors that left
and registers the new ones, so optimizer state exists exactly for what this peer trains.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from peer.config import TrainConfig


def _is_decayed(name: str, param: nn.Parameter) -> bool:
    # Norm gains and other vectors are not decayed (standard practice for LLM pretraining).
    return param.ndim >= 2


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with a decayed group (matrices) and a non-decayed group (vectors), trainable params only.

    torch's fused AdamW, on the CPU as on a GPU: one kernel per tensor, so no full-size temporaries at the step's peak
    (the per-tensor loop's `sqrt` and division copy the largest tensor twice) and faster on the CPU (bench.memory);
    on a GPU it can also skip a step on the device (`found_inf`, see peer/train.py) so the loop need not read the
    loss back every step. Its `step` counts live on the parameters' device."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if _is_decayed(name, param) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def _step_count(value: torch.Tensor | float, param: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).reshape(()).to(param.device)


def sync_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Make the optimizer's parameters exactly the model's trainable ones (after an ownership change)."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    live = {id(p) for p in trainable.values()}
    known: set[int] = set()
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            if id(p) in live:
                kept.append(p)
                known.add(id(p))
            else:
                optimizer.state.pop(p, None)
        group["params"] = kept
    groups = {g.get("name"): g for g in optimizer.param_groups}
    for name, p in trainable.items():
        if id(p) not in known:
            groups["decay" if _is_decayed(name, p) else "no_decay"]["params"].append(p)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at max_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def own_expert_bias_at(step: int, cfg: TrainConfig) -> float:
    """train.own_expert_bias, decayed linearly to 0 at own_expert_bias_decay * max_steps."""
    span = max(1.0, cfg.own_expert_bias_decay * cfg.max_steps)
    return cfg.own_expert_bias * max(0.0, 1.0 - step / span)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors `optim.<param name>.<key>` (for safetensors checkpoints)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for param, state in optimizer.state.items():
        name = names.get(id(param))
        if name is None:
            continue
        for key, value in state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(float(value))
            out[f"optim.{name}.{key}"] = tensor
    return out


def load_optimizer_state_tensors(optimizer: torch.optim.Optimizer, model: nn.Module,
                                 tensors: dict[str, torch.Tensor]) -> int:
    """Restore AdamW state for every trainable parameter found in `tensors`; returns how many were restored.

    Parameters without saved state (e.g. experts adopted since) start with fresh state.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    restored = 0
    for name, param in params.items():
        prefix = f"optim.{name}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and state[key].shape != param.shape:
                raise ValueError(f"optimizer state {name}.{key} has shape {tuple(state[key].shape)}, "
                                 f"expected {tuple(param.shape)}")
        optimizer.state[param] = {k: v.to(device=param.device, dtype=torch.float32) if k != "step"
                                  else _step_count(v, param) for k, v in state.items()}
        restored += 1
    return restored


def expert_moments(optimizer: torch.optim.Optimizer, model: nn.Module, expert: int) -> dict[str, torch.Tensor] | None:
    """The AdamW state of an owned expert, keyed like its tensors (`layers.{l}.{name}.exp_avg` / `.exp_avg_sq` /
    `.step`), for handing it to the expert's next owner; None if the expert has no state (not owned, or no
    step taken since it was). Copies: the serving thread reads them while training goes on.

    `step` is per tensor: AdamW counts a step only for a parameter that had a gradient, and an expert's copy in
    one layer that got no token in a step has none, so its layers' counts can differ (one shared count made the
    new owner's bias correction wrong for some layers)."""
    if expert not in model.owned_experts:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, param in zip(model.expert_tensor_names(), model.expert_parameters(expert)):
        state = optimizer.state.get(param)
        if not state or "exp_avg" not in state:
            return None
        out[f"{name}.exp_avg"] = state["exp_avg"].detach().float().cpu().clone()
        out[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().float().cpu().clone()
        out[f"{name}.step"] = torch.as_tensor(float(state["step"])).reshape(())
    return out


def adam_moment_bound(beta1: float, beta2: float) -> float:
    """The largest |exp_avg| / sqrt(exp_avg_sq) any gradient sequence can produce (both start at zero):
    Cauchy-Schwarz on the two moving averages gives (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) when b1^2 < b2
    (1.17 for 0.9 / 0.95). A received state beyond it was not made by AdamW, and its first update could be far
    larger than any honest one; within it, AdamW's step stays at most ~lr per element as usual."""
    if beta1 ** 2 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))


def load_expert_moments(optimizer: torch.optim.Optimizer, model: nn.Module, expert: int,
                        tensors: dict[str, torch.Tensor], betas: tuple[float, float]) -> str | None:
    """Install moments received for an owned expert (expert_moments' format, names and shapes already checked).
    Returns why they were refused (nothing installed), or None once installed."""
    if expert not in model.owned_experts:
        return "not owned"
    bound = adam_moment_bound(*betas) * 1.05 + 1e-6  # a little slack for float rounding
    steps = {}
    for name in model.expert_tensor_names():
        steps[name] = float(tensors[f"{name}.step"])
        if not (math.isfinite(steps[name]) and 1 <= steps[name] < 2 ** 40):
            return "bad step count"
        m, v = tensors[f"{name}.exp_avg"], tensors[f"{name}.exp_avg_sq"]
        if bool((v < 0).any()) or bool((m.abs() > bound * v.sqrt() + 1e-12).any()):
            return f"{name}: moments no AdamW run produces (|exp_avg| > {bound:.2f} sqrt(exp_avg_sq))"
    for name, param in zip(model.expert_tensor_names(), model.expert_parameters(expert)):
        optimizer.state[param] = {
            "step": _step_count(steps[name], param),
            "exp_avg": tensors[f"{name}.exp_avg"].to(param.device, torch.float32).clone(),
            "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(param.device, torch.float32).clone(),
        }
    return None
