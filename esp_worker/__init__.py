"""esp_worker: the ESP speculative-decoding engine (pure torch + transformers; never imports Ray)."""
from .config import EngineConfig, ModelConfig
from .types import GenerationParams, Request, RequestOutput, RequestStats, sample_requests

__all__ = [
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "GenerationParams",
    "Request",
    "RequestOutput",
    "RequestStats",
    "sample_requests",
    "load_model",
]


def __getattr__(name: str):  # lazy: importing the package stays cheap
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "load_model":
        from .model.load import load_model

        return load_model
    raise AttributeError(name)
