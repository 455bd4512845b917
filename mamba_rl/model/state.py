"""RecurrentState: the carried conv window and SSM state of every layer (docs/architecture.md, "Reset semantics")."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RecurrentState"]


@dataclass
class RecurrentState:
    """Recurrent state of a Mamba backbone for a batch of B rows (envs).

    Attributes:
        conv: [n_layers, B, d_inner, d_conv - 1] float32 (float64 in reference float64 mode); the last
            d_conv-1 pre-conv inputs ``xi`` of each row, oldest first.
        ssm: [n_layers, B, d_inner, d_state], same dtype; the SSM state s_t.

    ``layer="Mamba3"`` uses the subclass :class:`~mamba_rl.model.mamba3.Mamba3State` (same two slots, Mamba-3
    meaning); the methods below return the subclass they are called on.
    """

    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def batch(self) -> int:
        """Number of rows B."""
        return self.ssm.shape[1]

    @property
    def device(self) -> torch.device:
        return self.ssm.device

    def clone(self) -> "RecurrentState":
        """A detached deep copy."""
        return type(self)(self.conv.detach().clone(), self.ssm.detach().clone())

    def detach(self) -> "RecurrentState":
        """Views without autograd history."""
        return type(self)(self.conv.detach(), self.ssm.detach())

    def to(self, *args, **kwargs) -> "RecurrentState":
        """``Tensor.to`` applied to both tensors."""
        return type(self)(self.conv.to(*args, **kwargs), self.ssm.to(*args, **kwargs))

    def index(self, rows) -> "RecurrentState":
        """Rows ``rows`` (an index, slice, bool mask or LongTensor over B) of both tensors."""
        return type(self)(self.conv[:, rows], self.ssm[:, rows])

    def copy_(self, other: "RecurrentState") -> "RecurrentState":
        """In-place copy from ``other`` (same shapes); keeps this object's buffers (graph-safe)."""
        if not isinstance(other, RecurrentState):
            raise ValueError(f"RecurrentState.copy_: expected a RecurrentState, got {type(other).__name__}")
        if other.conv.shape != self.conv.shape or other.ssm.shape != self.ssm.shape:
            raise ValueError(
                f"RecurrentState.copy_: expected conv {list(self.conv.shape)} and ssm {list(self.ssm.shape)}, "
                f"got conv {list(other.conv.shape)} and ssm {list(other.ssm.shape)}")
        self.conv.copy_(other.conv)
        self.ssm.copy_(other.ssm)
        return self

    def zero_(self, mask: torch.Tensor | None = None) -> "RecurrentState":
        """Zero every row, or only the rows where ``mask`` ([B] bool) is True, in place and without a sync."""
        if mask is None:
            self.conv.zero_()
            self.ssm.zero_()
            return self
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (self.batch,):
            got = f"{type(mask).__name__}" if not isinstance(mask, torch.Tensor) else \
                f"shape {list(mask.shape)} dtype {mask.dtype}"
            raise ValueError(f"RecurrentState.zero_: mask must be a [{self.batch}] bool tensor, got {got}")
        m = mask.to(self.ssm.device).view(1, -1, 1, 1)
        self.conv.masked_fill_(m, 0.0)
        self.ssm.masked_fill_(m, 0.0)
        return self

    @staticmethod
    def zeros(n_layers, batch, d_inner, d_conv, d_state, device=None, dtype=torch.float32) -> "RecurrentState":
        """All-zero state."""
        return RecurrentState(torch.zeros(n_layers, batch, d_inner, d_conv - 1, device=device, dtype=dtype),
                              torch.zeros(n_layers, batch, d_inner, d_state, device=device, dtype=dtype))
