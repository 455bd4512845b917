"""MambaConfig: the hyperparameters of a Mamba backbone, validated at construction.

``layer`` picks the mixer: "Mamba1" (Gu & Dao 2023, the default) or "Mamba3" (SISO; Lahoti et al.,
"Mamba-3: Improved Sequence Modeling using State Space Principles", ICLR 2026, as mamba_ssm's ``Mamba3``
builds it; see :mod:`mamba_rl.model.mamba3`). Field names follow mamba_ssm.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

__all__ = ["MambaConfig", "LAYERS", "A_ACTIVATIONS"]

LAYERS = ("Mamba1", "Mamba3")
A_ACTIVATIONS = ("heavy_tail", "softplus")


def _check_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"MambaConfig.{name} must be an int in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"MambaConfig.{name} must be in [{lo}, {hi}], got {value}")


def _check_real(name, value, lo, hi):
    """A finite float in the open interval (lo, hi)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo < value < hi:
        raise ValueError(f"MambaConfig.{name} must be a finite float in ({lo}, {hi}), got {value!r}")


@dataclass(frozen=True)
class MambaConfig:
    """Hyperparameters of the backbone; names follow mamba_ssm (``Mamba`` and ``Mamba3``).

    Attributes:
        d_model: residual stream width, in [1, 8192] (default 128).
        n_layers: number of residual Mamba blocks, in [1, 128] (default 3).
        d_state: SSM state size N per channel, in [1, 256] (default 16).
        d_conv: depthwise causal conv kernel size, in [1, 16] (default 4).
        expand: d_inner = expand * d_model, in [1, 16] (default 2).
        dt_rank: rank of the dt projection, an int in [1, d_inner] or "auto" = ceil(d_model / 16).
        rms_norm_eps: epsilon of every RMSNorm, a finite float in (0, 1) (default 1e-5).
        layer: the mixer, "Mamba1" (selective scan after a causal conv) or "Mamba3" (SISO: trapezoidal, rotary, no conv) (default "Mamba1").
        headdim: Mamba3: channels per head P; d_inner must be a multiple (nheads = d_inner / headdim), in [1, 1024] (default 64).
        rope_fraction: Mamba3: share of d_state rotated by the data-dependent angles, 0.5 or 1.0 (default 0.5).
        dt_min: smallest dt of the initial dt bias (log-uniform in [dt_min, dt_max]), a float in (0, 10) (default 1e-3).
        dt_max: largest dt of the initial dt bias, a float in [dt_min, 10) (default 0.1).
        A_floor: Mamba3: A = min(-f(dd_A), -A_floor), so every head decays at least this fast per unit dt, in (0, 1) (default 1e-4).
        A_activation: Mamba3: f of A = min(-f(dd_A), -A_floor), "heavy_tail" (mamba_ssm's current: 1 + a for a >= 0, 1 / (1 - a) below) or "softplus" (the paper's code release) (default "heavy_tail").
        is_outproj_norm: Mamba3: a gated RMSNorm per head before out_proj, norm(y) * SiLU(z), instead of y * SiLU(z) (default False).

    d_conv and dt_rank are Mamba1-only (Mamba3 has neither a conv nor a dt projection); headdim,
    rope_fraction, A_floor, A_activation and is_outproj_norm are Mamba3-only; both layers read dt_min / dt_max. Every
    field is range-checked whatever the layer; the cross-field rules of Mamba3 (d_inner % headdim == 0,
    at least one rotary angle: int(d_state * rope_fraction) >= 2) only when layer == "Mamba3".

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
    layer: str = "Mamba1"
    headdim: int = 64
    rope_fraction: float = 0.5
    dt_min: float = 1e-3
    dt_max: float = 0.1
    A_floor: float = 1e-4
    A_activation: str = "heavy_tail"
    is_outproj_norm: bool = False
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
        if not isinstance(self.layer, str) or self.layer not in LAYERS:
            raise ValueError(f"MambaConfig.layer must be one of {LAYERS}, got {self.layer!r}")
        _check_int("headdim", self.headdim, 1, 1024)
        if isinstance(self.rope_fraction, bool) or self.rope_fraction not in (0.5, 1.0):
            raise ValueError(f"MambaConfig.rope_fraction must be 0.5 or 1.0 (mamba_ssm's choices), "
                             f"got {self.rope_fraction!r}")
        _check_real("dt_min", self.dt_min, 0, 10)
        _check_real("dt_max", self.dt_max, 0, 10)
        if self.dt_max < self.dt_min:
            raise ValueError(f"MambaConfig.dt_max must be >= dt_min = {self.dt_min}, got {self.dt_max!r}")
        _check_real("A_floor", self.A_floor, 0, 1)
        if not isinstance(self.A_activation, str) or self.A_activation not in A_ACTIVATIONS:
            raise ValueError(f"MambaConfig.A_activation must be one of {A_ACTIVATIONS}, got {self.A_activation!r}")
        if not isinstance(self.is_outproj_norm, bool):
            raise ValueError(f"MambaConfig.is_outproj_norm must be a bool, got {self.is_outproj_norm!r}")
        if self.layer == "Mamba3":
            if d_inner % self.headdim:
                raise ValueError(f"MambaConfig.headdim must divide d_inner = expand * d_model = {d_inner} "
                                 f"(layer 'Mamba3'), got {self.headdim}")
            if self.num_rope_angles < 1:
                raise ValueError(f"MambaConfig.d_state must give at least one rotary angle under layer 'Mamba3' "
                                 f"(int(d_state * rope_fraction) >= 2), got d_state {self.d_state} with "
                                 f"rope_fraction {self.rope_fraction}")

    @property
    def d_inner(self) -> int:
        """expand * d_model."""
        return self.expand * self.d_model

    @property
    def dt_rank_value(self) -> int:
        """dt_rank resolved to an int ("auto" -> ceil(d_model / 16))."""
        return self._dt_rank

    @property
    def nheads(self) -> int:
        """Mamba3: number of heads, d_inner // headdim."""
        return self.d_inner // self.headdim

    @property
    def num_rope_angles(self) -> int:
        """Mamba3: rotary angles per head R = floor(int(d_state * rope_fraction) / 2) (mamba_ssm's rule: the
        rotated part is made even); pairs (0,1) .. (2R-2, 2R-1) of the state rotate, the rest does not."""
        split = int(self.d_state * self.rope_fraction)
        return (split - split % 2) // 2

    def to_dict(self) -> dict:
        """JSON-able dict of the constructor fields."""
        d = asdict(self)
        d.pop("_dt_rank", None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MambaConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError, missing ones take their defaults (a
        Mamba-1 config saved before the Mamba-3 fields existed loads unchanged)."""
        known = {f.name for f in fields(cls) if f.init}
        extra = set(d) - known
        if extra:
            raise ValueError(f"MambaConfig: unknown fields {sorted(extra)}; expected a subset of {sorted(known)}")
        return cls(**d)
