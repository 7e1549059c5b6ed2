"""Server settings: defaults, overridden by `LETHE_*` environment variables, then by command-line flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEMO_MODEL = Path(__file__).resolve().parent.parent / "heads" / "demo" / "assets" / "model"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LETHE_")

    model: Path = Field(DEMO_MODEL, description="Local Hugging Face causal-LM directory.")
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens_limit: int = Field(512, gt=0, description="Largest max_new_tokens a request may ask for.")
    max_batch_size: int = Field(16, gt=0, description="Requests decoded together at most.")
    max_queue: int = Field(256, gt=0, description="Requests waiting at most; more answer 429.")
