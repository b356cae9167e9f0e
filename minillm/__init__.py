"""minillm: a small, fast, hackable LLM inference engine on fused Triton kernels.

The names below load on first use (PEP 562), so `minillm --help` and argument errors answer
without importing torch (2.7 s on the H200 machine)."""
import importlib

_EXPORTS = {"LLM": "api", "MiniLLMError": "checks", "PRESETS": "config", "GPTConfig": "config",
            "ContextLengthError": "checks", "GenerationResult": "api", "NonFiniteLogitsError": "checks",
            "ModelLoadError": "loader", "SamplingParams": "sampling", "UnappliedSettingsWarning": "checks"}
__all__ = ["LLM", "SamplingParams", "GenerationResult", "GPTConfig", "PRESETS", "MiniLLMError", "ModelLoadError",
           "ContextLengthError", "NonFiniteLogitsError", "UnappliedSettingsWarning"]
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
