"""Parameter layout and initialisation of the Mamba-1 backbone (mamba_ssm's, so checkpoints map one to one).

Names follow HF / mamba_ssm (``layers.{i}.mixer.in_proj.weight``, ...). The values follow mamba_ssm's
``Mamba.__init__`` and ``MixerModel._init_weights`` with the prenorm rescaling of ``out_proj``: S4D-real
``A_log = log(1..N)``, ``D = 1``, dt drawn log-uniformly in [1e-3, 1e-1] and stored as its inverse
softplus in ``dt_proj.bias``, ``nn.Linear`` / ``nn.Conv1d`` defaults elsewhere, norms at 1.
"""
from __future__ import annotations

import math

import torch

from ..config import MambaConfig

__all__ = ["param_layout", "is_no_decay", "init_values", "GEMM_PARAMS"]

GEMM_PARAMS = ("in_proj.weight", "x_proj.weight", "dt_proj.weight", "out_proj.weight")
_NO_DECAY_SUFFIXES = (".A_log", ".D", ".dt_proj.bias", ".norm.weight")


def is_no_decay(name: str) -> bool:
    """True for the parameters the "reference" no-decay group exempts: A_log, D, dt_proj.bias, norms."""
    return name == "norm_f.weight" or name.endswith(_NO_DECAY_SUFFIXES)


def param_layout(cfg: MambaConfig, input_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    """[(name, shape)] of every parameter, in model order."""
    d, di, n, k, r = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank_value
    out = [("input_proj.weight", (d, input_dim)), ("input_proj.bias", (d,))]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out += [(p + "norm.weight", (d,)),
                (p + "mixer.in_proj.weight", (2 * di, d)),
                (p + "mixer.conv1d.weight", (di, 1, k)),
                (p + "mixer.conv1d.bias", (di,)),
                (p + "mixer.x_proj.weight", (r + 2 * n, di)),
                (p + "mixer.dt_proj.weight", (di, r)),
                (p + "mixer.dt_proj.bias", (di,)),
                (p + "mixer.A_log", (di, n)),
                (p + "mixer.D", (di,)),
                (p + "mixer.out_proj.weight", (d, di))]
    out.append(("norm_f.weight", (d,)))
    return out


def _value(name: str, shape, cfg: MambaConfig, input_dim: int, gen: torch.Generator) -> torch.Tensor:
    def uniform(bound):
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound

    key = ".".join(name.split(".")[-2:])
    if key.endswith("norm.weight") or name == "norm_f.weight" or key == "mixer.D":
        return torch.ones(shape, dtype=torch.float64)
    if key == "mixer.A_log":
        return torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float64)).expand(shape).clone()
    if key == "dt_proj.weight":
        return uniform(cfg.dt_rank_value ** -0.5)
    if key == "dt_proj.bias":
        dt_min, dt_max = cfg.dt_min, cfg.dt_max  # mamba_ssm's defaults 1e-3, 1e-1
        dt = torch.exp(torch.rand(shape, generator=gen, dtype=torch.float64)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if key in ("conv1d.weight", "conv1d.bias"):
        return uniform(1.0 / math.sqrt(cfg.d_conv))  # nn.Conv1d default: fan_in = 1 * d_conv
    if name == "input_proj.bias":  # nn.Linear default: bound from the weight's fan_in
        return uniform(1.0 / math.sqrt(input_dim))
    # nn.Linear default weight (kaiming_uniform with a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    w = uniform(1.0 / math.sqrt(shape[1]))
    if key == "out_proj.weight":
        w = w / math.sqrt(cfg.n_layers)  # mamba_ssm rescale_prenorm_residual, one residual per layer
    return w


def init_values(cfg: MambaConfig, input_dim: int, seed: int) -> dict[str, torch.Tensor]:
    """name -> float64 initial value, drawn in model order from a CPU generator seeded with ``seed`` (so the
    init is the same on every device and does not depend on the arena's order)."""
    gen = torch.Generator().manual_seed(int(seed))
    return {name: _value(name, shape, cfg, input_dim, gen) for name, shape in param_layout(cfg, input_dim)}
