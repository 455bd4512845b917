"""MambaConfig: the hyperparameters of a Mamba-1 backbone (Gu & Dao 2023), validated at construction."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["MambaConfig"]


def _check_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MambaConfig.{name} must be an int in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"MambaConfig.{name} must be in [{lo}, {hi}], got {value}")


@dataclass(frozen=True)
class MambaConfig:
    """Hyperparameters of the backbone; names follow mamba_ssm.

    Attributes:
        d_model: residual stream width, in [1, 8192] (default 128).
        n_layers: number of residual Mamba blocks, in [1, 128] (default 3).
        d_state: SSM state size N per channel, in [1, 256] (default 16).
        d_conv: depthwise causal conv kernel size, in [1, 16] (default 4).
        expand: d_inner = expand * d_model, in [1, 16] (default 2).
        dt_rank: rank of the dt projection, an int in [1, d_inner] or "auto" = ceil(d_model / 16).
        rms_norm_eps: epsilon of every RMSNorm, a finite float in (0, 1) (default 1e-5).

    Raises:
        ValueError: naming the field, the value received and the allowed range.
    """

    d_model: int = 128
    n_layers: int = 3
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"
    rms_norm_eps: float = 1e-5
    _dt_rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_int("d_model", self.d_model, 1, 8192)
        _check_int("n_layers", self.n_layers, 1, 128)
        _check_int("d_state", self.d_state, 1, 256)
        _check_int("d_conv", self.d_conv, 1, 16)
        _check_int("expand", self.expand, 1, 16)
        d_inner = self.expand * self.d_model
        if self.dt_rank == "auto":
            r = math.ceil(self.d_model / 16)
        else:
            _check_int("dt_rank", self.dt_rank, 1, d_inner)
            r = self.dt_rank
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or not 0 < eps < 1:
            raise ValueError(f"MambaConfig.rms_norm_eps must be a finite float in (0, 1), got {eps!r}")
        object.__setattr__(self, "_dt_rank", r)

    @property
    def d_inner(self) -> int:
        """expand * d_model."""
        return self.expand * self.d_model

    @property
    def dt_rank_value(self) -> int:
        """dt_rank resolved to an int ("auto" -> ceil(d_model / 16))."""
        return self._dt_rank

    def to_dict(self) -> dict:
        """JSON-able dict of the constructor fields."""
        d = asdict(self)
        d.pop("_dt_rank", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MambaConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        known = {"d_model", "n_layers", "d_state", "d_conv", "expand", "dt_rank", "rms_norm_eps"}
        extra = set(d) - known
        if extra:
            raise ValueError(f"MambaConfig: unknown fields {sorted(extra)}; expected a subset of {sorted(known)}")
        return cls(**d)
