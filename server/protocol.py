"""Request and response schemas of the HTTP API, apart from the serving logic.

Unknown fields are rejected, so a misspelt option is an error rather than a
silently ignored setting. New optional fields (a profile, streaming) can be
added without breaking existing clients.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from heads.sampling import SamplingParams


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(Strict):
    max_new_tokens: int = Field(64, gt=0, description="Tokens to generate at most (the server caps it).")
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="Nucleus mass, in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k likeliest tokens; 0 keeps all.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings (not returned).")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=[s for s in self.stop if s])


class ProfileSpec(Strict):
    """An unlearning profile: which backend, which head, and the tilt settings.

    Settings left out come from `preset`, else from the head's own recommendation.
    """

    backend: Literal["t3", "base", "asu"] = "t3"
    head: str | None = Field(None, description="Head id (backend t3, or asu combined with a head).")
    weights: str | None = Field(None, description="ASU weights id (backend asu).")
    preset: Literal["default", "paper"] | None = None
    T: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description="Tempering temperature.")
    lam: float | None = Field(None, ge=0, le=1000, allow_inf_nan=False, description="Tilt strength.")
    gate: bool | None = None
    candidates: int | None = Field(None, ge=0, le=100_000)
    cap: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    note: str | None = Field(None, max_length=500, description="Free text kept with the version.")

    def spec(self) -> dict:
        return self.model_dump(exclude_none=True, exclude={"note"})


class GenerateRequest(SamplingFields):
    prompt: str = Field(min_length=1, description="Text to continue.")
    profile: str | ProfileSpec | None = Field(None, description="A profile name, `base`, or an inline profile.")
    stream: bool = Field(False, description="Send text as server-sent events.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ProfileUsed(BaseModel):
    name: str | None
    version: int | None


class GenerateResponse(BaseModel):
    text: str
    finish_reason: Literal["stop", "length", "abort"]
    usage: Usage
    profile: ProfileUsed | None = None


class DatasetOut(BaseModel):
    id: str
    name: str | None
    records: int
    sha256: str
    bytes: int
    created: float


class HeadJobRequest(Strict):
    forget: str = Field(description="Dataset id of the forget set.")
    retain: str = Field(description="Dataset id of the retain set.")
    rank: int = Field(20, ge=1, le=1024)
    lr: float = Field(1e-2, gt=0, le=1, allow_inf_nan=False)
    weight_decay: float = Field(1e-2, ge=0, le=1, allow_inf_nan=False)
    max_epochs: int = Field(60, ge=1, le=1000)
    balance: bool = True
    common_df: float = Field(0.05, gt=0, le=1, allow_inf_nan=False)
    seed: int = Field(0, ge=0)


class ASUJobRequest(Strict):
    forget: str = Field(description="Dataset id of the forget set.")
    retain: str = Field(description="Dataset id of the retain set.")
    tau: float = Field(16.0, gt=1, le=1000, allow_inf_nan=False, description="Teacher attention temperature.")
    layers: str | None = Field(None, pattern=r"^(all|\d+(-\d+)?(,\d+(-\d+)?)*)$", description="e.g. 0-1,3")
    lora_rank: int = Field(8, ge=1, le=256)
    full_layers: str | None = Field(None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
                                    description="Train these layers' projections in full instead of LoRA.")
    retain_loss: Literal["gd", "kl"] = "gd"
    retain_weight: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    lr: float = Field(2e-3, gt=0, le=1, allow_inf_nan=False)
    steps: int = Field(300, ge=1, le=100_000)
    seed: int = Field(0, ge=0)


class EvalJobRequest(Strict):
    forget: str = Field(description="Dataset id of the forget set (TOFU fields).")
    retain: str = Field(description="Dataset id of the retain set (TOFU fields).")
    profile: str | ProfileSpec = Field("base", description="A profile name, `base`, or an inline profile.")
    seeds: list[int] = Field(default_factory=list, max_length=10, description="Sampling seeds (temperature 1).")
    max_new_tokens: int = Field(64, ge=1, le=512)


class ASUOut(BaseModel):
    id: str
    job: str | None
    bytes: int
    created: float
    tau: float
    layers: list[int]
    lora_rank: int
    steps: int
    metrics: dict


class JobOut(BaseModel):
    id: str
    kind: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    phase: str | None
    progress: float
    metrics: dict | None
    head: str | None = Field(None, description="The head a t3 job made, once it succeeded.")
    weights: str | None = Field(None, description="The ASU weights an asu job made, once it succeeded.")
    error: str | None
    created: float
    started: float | None
    finished: float | None


class HeadOut(BaseModel):
    id: str
    job: str | None
    bytes: int
    created: float
    rank: int
    metrics: dict
    profile: dict = Field(description="Recommended settings.")


class ProfileOut(BaseModel):
    name: str
    version: int
    spec: dict
    history: list[dict] = []


class TenantRequest(Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")


class TenantOut(BaseModel):
    id: str
    name: str
    api_key: str = Field(description="Shown once; only its hash is stored.")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    fingerprint: str
