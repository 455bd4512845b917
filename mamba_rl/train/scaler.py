"""The dynamic loss scaler of f16 training, held in device tensors (``torch.amp.GradScaler`` semantics).

Gradients arrive multiplied by ``loss_scale``; a step whose gradients hold an inf/NaN is skipped (weights,
moments and step counter unchanged, see :mod:`mamba_rl.ops.optim`); the scale is halved on such a step and
doubled after ``growth_interval`` clean steps (``torch._amp_update_scale_``), with no host sync.
"""
from __future__ import annotations

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scale with ``torch.amp.GradScaler`` semantics, held in device tensors.

    Args:
        enabled: False keeps the scale at 1 and never skips (f32 / bf16).
        init_scale: 2**16; growth_factor 2.0; backoff_factor 0.5; growth_interval 2000 clean steps.
    """

    def __init__(self, device, enabled: bool, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        if growth_interval < 1 or not growth_factor > 1 or not 0 < backoff_factor < 1 or not init_scale > 0:
            raise ValueError(f"LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        self.enabled = enabled
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.scale = torch.full((1,), init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)

    def update(self, found_inf64: torch.Tensor):
        """Advance the scale from the step's overflow flag (a device scalar); no host sync."""
        if not self.enabled:
            return
        self._found_inf.copy_(found_inf64.reshape(1))
        torch._amp_update_scale_(self.scale, self.growth_tracker, self._found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": float(self.scale.item()),
                "growth_tracker": int(self.growth_tracker.item()), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, sd: dict):
        """Adopt a saved scaler. A disabled scaler (f32/bf16) keeps scale 1 whatever was saved; an f16
        scaler loading a checkpoint of a run without one starts from the initial scale."""
        self.growth_factor, self.backoff_factor = float(sd["growth_factor"]), float(sd["backoff_factor"])
        self.growth_interval = int(sd["growth_interval"])
        if not self.enabled:
            self.scale.fill_(1.0)
            self.growth_tracker.zero_()
        elif sd.get("enabled", True):
            self.scale.fill_(float(sd["scale"]))
            self.growth_tracker.fill_(int(sd["growth_tracker"]))
        else:
            self.scale.fill_(2.0 ** 16)
            self.growth_tracker.zero_()
