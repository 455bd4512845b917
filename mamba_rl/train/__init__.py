"""Training: the trainer (fused and split steps, CUDA graphs), the f16 loss scaler and checkpoints."""
from .checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint
from .scaler import LossScaler
from .trainer import DTYPES, MambaTrainer, StepMetrics

__all__ = ["MambaTrainer", "StepMetrics", "DTYPES", "LossScaler", "save_checkpoint", "load_checkpoint",
           "read_checkpoint", "CheckpointError"]
