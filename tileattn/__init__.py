"""tileattn: exact FlashAttention (forward and backward) for NumPy and CuPy users.

``import tileattn`` loads NumPy only; the Numba (CPU) and CuPy (GPU) backends load when chosen.
"""

from .api import backward, forward
from .backends import BackendUnavailableError, available
from .options import Blocks

__all__ = ["forward", "backward", "available", "Blocks", "BackendUnavailableError"]
__version__ = "0.1.0"
