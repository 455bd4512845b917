"""Mamba ops: each module holds the CUDA call and its pure-torch ``*_ref`` twin (the float64 oracle)."""
from .conv import causal_conv1d, causal_conv1d_ref
from .scan import selective_scan, selective_scan_ref
from .norm import rms_norm, rms_norm_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref", "selective_scan", "selective_scan_ref",
           "rms_norm", "rms_norm_ref"]
