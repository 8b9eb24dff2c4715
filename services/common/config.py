"""Frozen configuration dataclasses (no module-level mutable config)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = Path(os.environ.get("SPECMESH_MODELS", REPO_ROOT / "models"))


@dataclass(frozen=True)
class EngineConfig:
    target: Path = MODELS_DIR / "target"
    draft: Path | None = MODELS_DIR / "draft"
    device: str = "cpu"
    dtype: str = "float32"
    num_speculative_tokens: int = 4       # k for model drafters; tuned by `specmesh bench`
    max_new_tokens_limit: int = 1024
    default_max_new_tokens: int = 128
    default_method: str = "sd"
    threads: int = 0                      # torch intra-op threads; 0 = torch default


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_sessions: int = 8                 # concurrent Generate streams; beyond → RESOURCE_EXHAUSTED
    workers: int = 16
    max_message_bytes: int = 4 * 1024 * 1024
