"""Mamba ops. Each module pairs an op's float64-capable pure-torch reference (``*_ref``, the oracle of every
parity test) with its kernel autograd Function and one public function that dispatches: the CUDA or CPU
kernel when :func:`~mamba_rl.ops.extension.kernels_for` finds one that takes the inputs, else the reference
(as mamba_ssm's ``selective_scan_interface.py`` pairs each kernel with its reference)."""
from .conv import causal_conv1d, causal_conv1d_ref
from .norm import rms_norm, rms_norm_ref
from .scan import selective_scan, selective_scan_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref", "selective_scan", "selective_scan_ref",
           "rms_norm", "rms_norm_ref"]
