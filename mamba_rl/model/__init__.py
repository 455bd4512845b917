"""The model: the flat parameter arena, the initialisation, the Mamba block, the backbone and the stepper."""
from .backbone import BACKENDS, MambaBackbone
from .block import MambaBlock
from .state import RecurrentState
from .stepper import Stepper

__all__ = ["MambaBackbone", "MambaBlock", "RecurrentState", "Stepper", "BACKENDS"]
