"""Server settings: defaults, overridden by `LETHE_*` environment variables, then by command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, FilePath, model_validator
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
    max_rows_per_caller: int | None = Field(None, gt=0, description="Rows of the batch one tenant (or the anonymous "
                                                                    "callers together) may hold at once (default half the "
                                                                    "batch): fewer keep others' latency lower, more "
                                                                    "(up to the batch) one caller's throughput.")
    max_queue: int = Field(256, gt=0, description="Requests waiting at most; more answer 429.")
    data_dir: Path = Field(Path("lethe-data"), description="SQLite metadata, datasets and heads.")
    database_url: str | None = Field(None, description="Metadata database: SQLite in the data directory by default; "
                                                       "postgresql://user@host/db to share it between replicas.")
    blob_url: str | None = Field(None, description="Where dataset, head and adapter files live: <data dir>/blobs by "
                                                   "default; a shared directory or an fsspec URL (s3://bucket/lethe) "
                                                   "for replicas on several machines.")
    blob_cache: Path | None = Field(None, description="This replica's copies of a remote blob store's files "
                                                      "(default <data dir>/blob-cache).")
    job_cpus: float = Field(1.0, gt=0, description="On Ray Serve: CPUs a training or evaluation job reserves "
                                                   "(each job is a Ray task of its own, beside the replicas).")
    job_gpus: float = Field(0.0, ge=0, description="On Ray Serve: GPUs a job reserves (default: 1 where the "
                                                   "replicas use CUDA, else 0).")
    job_stale_seconds: float = Field(60.0, gt=0, description="A running job without a heartbeat for this long lost "
                                                             "its worker (a replica that died): it is marked failed.")
    max_job_seconds: float = Field(3600.0, gt=0, description="A job still running after this many seconds is stopped "
                                                           "and failed, saying so: no tenant holds the job worker "
                                                           "for hours.")
    job_turn_seconds: float = Field(20.0, gt=0, description="A running job computes this long before a waiting job "
                                                            "of another tenant takes a turn (jobs take turns, one "
                                                            "computing at a time).")
    job_slots: int = Field(2, gt=0, description="Jobs started at once, each of another tenant, taking turns "
                                                "(each holds a copy of the model).")
    admin_key: str | None = Field(None, description="Bearer key for the admin endpoints (tenants, keys).")
    allow_anonymous: bool | None = Field(None, description="Requests without a key may generate from the base model "
                                                           "(default: only on the embedded demo model).")
    metrics_public: bool = Field(False, description="/metrics without the admin key (serving load only; jobs and "
                                                    "profile use stay the admin key's).")
    demo_tenant: bool = Field(True, description="On first start, create a 'demo' tenant and print its key.")
    max_upload_bytes: int = Field(50 * 2**20, gt=0, description="Largest dataset upload; more answer 413.")
    max_dataset_records: int = Field(50_000, gt=0, description="Records a dataset may hold; more answer 422.")
    max_request_bytes: int = Field(2**20, gt=0, description="Largest JSON request body; more answer 413.")
    max_logprob_entries: int = Field(200_000, gt=0, description="Log-probability entries one answer may hold (choices "
                                                                "x tokens x (1 + alternatives), twice with untilted "
                                                                "ones); more answer 400.")
    body_timeout: float = Field(30.0, gt=0, description="Seconds a request body may stall; then 408.")
    quota_datasets: int = Field(100, gt=0, description="Datasets a tenant may hold; more answer 429.")
    quota_dataset_bytes: int = Field(2**30, gt=0, description="Bytes of datasets a tenant may hold.")
    quota_heads: int = Field(100, gt=0, description="Heads a tenant may hold (counting jobs that will add one).")
    quota_asu_weights: int = Field(20, gt=0, description="ASU weights a tenant may hold (likewise).")
    quota_jobs: int = Field(4, gt=0, description="Queued or running jobs per tenant; jobs run fairly by tenant.")
    quota_rows: int = Field(32, gt=0, description="Generation requests in flight per tenant (and for anonymous "
                                                 "callers together); more answer 429 with Retry-After.")
    head_cache_size: int = Field(64, gt=0, description="Heads kept in memory (least recently used go first).")
    adapter_cache_size: int = Field(16, gt=0, description="ASU adapters attached to the model at most.")
    max_model_len: int | None = Field(None, gt=0, description="Prompt plus new tokens at most (default: the "
                                                               "model's context length; never more).")
    served_model_name: str | None = Field(None, min_length=1, max_length=200,
                                          description="A name for the base model on the OpenAI routes, beside `base`.")
    chat_template: FilePath | None = Field(None, description="A Jinja chat template file, used instead of the "
                                                         "tokenizer's.")
    engine: Literal["torch", "llamacpp"] = Field("torch", description="What decodes: `torch` (transformers, the "
                                                                  "model as loaded) or `llamacpp` (llama.cpp on the "
                                                                  "GGUF file: its quantized weights, several times "
                                                                  "faster on a CPU; no ASU adapters).")
    gguf: Path | None = Field(None, description="The GGUF file the llama.cpp engine decodes (default: the model, "
                                                "when it is a GGUF file).")

    @model_validator(mode="after")
    def _anonymous_on_the_demo_only(self):
        if self.allow_anonymous is None:
            self.allow_anonymous = Path(self.model).resolve() == DEMO_MODEL
        return self

    @model_validator(mode="after")
    def _gguf_needs_llamacpp(self):
        if self.gguf is not None and self.engine != "llamacpp":
            raise ValueError("gguf names the file the llama.cpp engine decodes: give engine llamacpp too")
        return self


def read_config(path: Path) -> dict:
    """Settings from a TOML or JSON file (`lethe serve --config FILE`): the same names as the flags and the
    LETHE_* variables, with underscores (max_batch_size = 8)."""
    import json
    import tomllib

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    try:
        values = json.loads(text) if Path(path).suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not valid {'JSON' if Path(path).suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must hold a table of settings (name = value), not a {type(values).__name__}")
    unknown = set(values) - set(Settings.model_fields)
    if unknown:
        raise ValueError(f"{path}: unknown settings: {', '.join(sorted(unknown))}")
    return values
