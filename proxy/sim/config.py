"""Configuration of one simulated replica.

Owns `SimConfig` and its named defaults. The defaults describe a small GPU:
8 sequences at once, a 10 ms decode step that grows by 1.5 ms per running
sequence (so throughput rises and then flattens, while per-token latency keeps
climbing), and prefill at 0.05 ms per prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.sim.faults import Faults

__all__ = [
    "DEFAULT_DECODE_BASE_MS",
    "DEFAULT_DECODE_PER_SEQ_MS",
    "DEFAULT_KV_CACHE_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PREFILL_MS_PER_TOKEN",
    "DEFAULT_SEED",
    "DEFAULT_SLOTS",
    "SimConfig",
]

DEFAULT_SLOTS = 8
DEFAULT_KV_CACHE_TOKENS = 65536
DEFAULT_PREFILL_MS_PER_TOKEN = 0.05
DEFAULT_DECODE_BASE_MS = 10.0
DEFAULT_DECODE_PER_SEQ_MS = 1.5
DEFAULT_MAX_TOKENS = 64
DEFAULT_SEED = 0
DEFAULT_MODEL_NAME = "sim-model"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything that shapes one simulated replica; validated on construction.

    `max_waiting=None` leaves the waiting queue unbounded; otherwise a request
    that would make it longer is refused with 503 at once. `faults` is only
    the initial fault state: it can change at runtime.
    """

    slots: int = DEFAULT_SLOTS
    max_waiting: int | None = None
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_base_ms: float = DEFAULT_DECODE_BASE_MS
    decode_per_seq_ms: float = DEFAULT_DECODE_PER_SEQ_MS
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = DEFAULT_SEED
    model_name: str = DEFAULT_MODEL_NAME
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if self.kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2, got {self.kv_cache_tokens}")
        for name in ("prefill_ms_per_token", "decode_base_ms", "decode_per_seq_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_base_ms + self.decode_per_seq_ms <= 0:
            raise ValueError("decode_base_ms + decode_per_seq_ms must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
