"""minillm: a small, fast, hackable LLM inference engine on fused Triton kernels."""
from .api import LLM, MiniLLMError
from .config import PRESETS, GPTConfig
from .generate import ContextLengthError, GenerationResult, NonFiniteLogitsError
from .loader import ModelLoadError
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationResult", "GPTConfig", "PRESETS", "MiniLLMError", "ModelLoadError",
           "ContextLengthError", "NonFiniteLogitsError"]
__version__ = "0.1.0"
