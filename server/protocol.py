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


class GenerateRequest(SamplingFields):
    prompt: str = Field(min_length=1, description="Text to continue.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    text: str
    finish_reason: Literal["stop", "length", "abort"]
    usage: Usage


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    fingerprint: str
