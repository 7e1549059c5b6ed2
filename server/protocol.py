"""Request and response schemas of the HTTP API, apart from the serving logic.

Unknown fields are rejected, so a misspelt option is an error rather than a
silently ignored setting. New optional fields (a profile, streaming) can be
added without breaking existing clients.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, field_validator, model_validator

from lethe.heads.t3.guide import MAX_CANDIDATES, MAX_REPEAT_GUARD, MAX_REPLY, MIN_T
from lethe.heads.t3.cache import CACHE_PRECISIONS
from lethe.heads.t3.contexts import MAX_PER_FORGET
from lethe.heads.t3.pooling import DEFAULT_WINDOW, MAX_WINDOW
from lethe.heads.records import text_problem
from lethe.heads.decoding.sampling import MAX_NEW_TOKENS, MAX_SEED, MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_K, SamplingParams

MAX_PROMPT_CHARS = 1_000_000  # beyond any context we serve; the body limit bounds it first anyway
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]


class ValidText(BaseModel):
    """Base of every request schema: every string, however deep, valid Unicode (JSON escapes can make lone
    surrogates, which no tokenizer encodes): one check for every schema, so no field is forgotten. A nested
    schema checks its own fields."""

    @model_validator(mode="after")
    def _valid_unicode(self):
        problem = text_problem({name: getattr(self, name) for name in type(self).model_fields})
        if problem:
            raise ValueError(problem)
        return self


class Strict(ValidText):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(Strict):
    max_new_tokens: int = Field(64, gt=0, le=MAX_NEW_TOKENS, description="Tokens to generate at most (the server "
                                                                         "caps it).")
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="Nucleus mass, in (0, 1].")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Keep the k likeliest tokens; 0 keeps all.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed for reproducible sampling.")
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOPS,
                                   description="Stop strings (not returned).")

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
    T: float | None = Field(None, ge=MIN_T, le=100, allow_inf_nan=False, description="Tempering temperature.")
    lam: float | None = Field(None, ge=0, le=1000, allow_inf_nan=False, description="Tilt strength.")
    gate: StrictBool | None = None
    sticky_gate: StrictBool | None = Field(None, description="Once the gate opens in an answer, it stays at least "
                                                             "as open for the rest of that answer.")
    head_gate: float | None = Field(None, ge=0, le=100, allow_inf_nan=False,
                                    description="The gate also opens where the head scores the base model's likeliest "
                                                "next token below -head_gate (forget e^head_gate times likelier than "
                                                "retain there), whatever the probe says of the context (0: off; not given "
                                                "and no preset: the head's recommendation, calibrated on the base "
                                                "model's own retain answers when it was trained).")
    flagged_mass: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False,
                                       description="A step is tempered and tilted only where the tokens the head flags "
                                                   "(of those the row may sample) hold at least this much of the base "
                                                   "model's probability; other steps keep the base logits (0: off). "
                                                   "Generation only: log-likelihood scoring tilts every position "
                                                   "the gate lets in.")
    candidates: int | None = Field(None, ge=0, le=MAX_CANDIDATES)
    cap: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    max_push: float | None = Field(None, ge=0, le=100, allow_inf_nan=False,
                                   description="With the cap: the tilt lowers a token the head flags at most this many "
                                               "nats below where the cap holds it (its untilted score, or the best "
                                               "unflagged token minus the cap, where that is lower), so a forgotten "
                                               "answer scores among the answers the model finds plausible, not far "
                                               "below them (100: no limit in practice).")
    min_p: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False,
                                description="Forget-like contexts: drop candidates below min_p x the best token's "
                                            "probability (0: off).")
    repeat_guard: int | None = Field(None, ge=0, le=MAX_REPEAT_GUARD,
                                     description="Forget-like contexts: no word that repeats a word n-gram of the "
                                                 "answer, for this n (0: off; 1 is refused). In an asu profile "
                                                 "without a head: its rows' guard, where their adapter acts "
                                                 "(default 0 there; 3 for gated weights).")
    word_guard: StrictBool | None = Field(None, description="Forget-like contexts: where the head flags the base "
                                                            "model's likeliest token and it starts a word, no token "
                                                            "that would continue the current word instead (no word "
                                                            "fragments glued onto a name).")
    whole_words: StrictBool | None = Field(None, description="Forget-like contexts: where the tilt turns away the base "
                                                             "model's likeliest token, a word start the head flags, no "
                                                             "unflagged word start the base model would go on "
                                                             "spelling, where one it would end there is left (a "
                                                             "one-token lookahead, a forward pass at each such step; "
                                                             "rows on the base weights; default off).")
    abstain: str | None = Field(None, min_length=1, max_length=MAX_REPLY,
                                description="A reply (e.g. \"I don't know.\") given instead of an answer when the "
                                            "head's probe calls the prompt alone forget-like.")
    abstain_above: float | None = Field(None, ge=0.5, lt=1, allow_inf_nan=False,
                                        description="The probe's P(forget | prompt) above which `abstain` answers.")
    adapter_above: float | None = Field(
        None, ge=0, lt=1, allow_inf_nan=False,
        description="Backend asu with a head: decode with the ASU adapter only where the head's probe gives "
                    "P(forget | prompt) above this, else with the base weights and the head (0: the adapter always).")
    note: str | None = Field(None, max_length=500, description="Free text kept with the version.")

    def spec(self) -> dict:
        return self.model_dump(exclude_none=True, exclude={"note"})


class GenerateRequest(SamplingFields):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="Text to continue.")
    profile: str | ProfileSpec | None = Field(None, description="A profile name, `base`, or an inline profile.")
    stream: StrictBool = Field(False, description="Send text as server-sent events.")


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
    seed: int = Field(0, ge=0, le=MAX_SEED)
    format: Literal["auto", "chat", "qa", "raw"] = Field(
        "auto", description="How question/answer records become text: `chat` (the model's chat template, as "
                            "/v1/chat/completions asks), `qa` (Question: ... Answer:), `raw`; `auto`: chat where "
                            "the model has a template, else qa.")
    pooling_window: int = Field(
        DEFAULT_WINDOW, ge=0, le=MAX_WINDOW, description="The head reads the mean of the last this many tokens' states, so text "
                                            "before the question does not dilute it; 0: the whole context's mean "
                                            "(the published T3's).")
    answer_forms: bool = Field(True, description="Records with a `fact` field (the answer's span that is the "
                                                 "knowledge) also train with the fact alone as the answer, the form "
                                                 "multiple-choice scoring reads.")
    fact_spans: bool = Field(False, description="A forget record with a `fact` field trains the head as forget on "
                                               "the fact's tokens and on words no retain answer uses; its other "
                                               "words (template words retain answers also say) train the gate's "
                                               "probe alone, so retain answers keep them after forget-like text "
                                               "(off by default: it weakened forgetting under chat-form "
                                               "log-likelihood scoring on SmolLM2). False: `common_df` alone "
                                               "decides.")
    contexts: float = Field(1.0, ge=0, le=MAX_PER_FORGET, allow_inf_nan=False,
                            description="Examples per forget record that train after a context (a preamble, a system "
                                        "prompt, earlier turns, other text), with twice as many retain ones, so the "
                                        "head forgets wherever traffic puts the question; 0: off, 2: stronger in "
                                        "context at about twice the training time.")
    context_shift: float = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                                 description="The share of training rows, drawn afresh in every batch, that also get "
                                             "a context's change of the pooled state (what one of the trained "
                                             "contexts did to the same answer's states), so the head holds in "
                                             "contexts it never saw, at no extra pass of the model; 0: off. An "
                                             "option, not the default: docs/forgetting-in-context.md gives what it "
                                             "gained and cost.")
    gate_answers: int = Field(64, ge=0, le=1024,
                              description="Retain questions the base model answers (greedy) once the head is fitted: "
                                          "the head's recommended `head_gate` is one nat past the lowest head logit "
                                          "of a token those answers chose, so none of them would open the gate; "
                                          "0: the head recommends no head_gate.")
    cache_precision: Literal[CACHE_PRECISIONS] = Field(
        "auto", description="The dtype of the cache pass's matrix products: `auto`, bfloat16 for a float32 model on "
                            "a CPU that computes it natively (about twice as fast there; the cached states within a "
                            "few tenths of a percent of float32's), the model's own elsewhere; `model`, always the "
                            "model's own. The head's `metrics.cache_dtype` says which ran.")


class ASUJobRequest(Strict):
    forget: str = Field(description="Dataset id of the forget set.")
    retain: str = Field(description="Dataset id of the retain set.")
    preset: Literal["lethe", "minimal"] = Field("lethe", description=(
        "Where the settings below are not given: `lethe`, the recipe measured best on SmolLM2 (the teacher's pick, "
        "adapters in its tempered layers, own answers, KL retain loss weight 5 along the model's own retain "
        "answers, 100 steps, a gate where the adapters start past the first layer); `minimal`, the release "
        "before's (adapters in every layer, the sets' answers, gd retain loss weight 1, 300 steps, no gate)."))
    tau: float | None = Field(None, gt=1, le=1000, allow_inf_nan=False, description=(
        "Teacher attention temperature. Omitted: the job's teacher phase measures the candidates (`lethe asu "
        "teacher`) on the forget set's question/answer records and takes its pick, with its layers unless "
        "`layers` is given; 16 on the given (or every) layer where no candidate qualifies."))
    layers: str | None = Field(None, pattern=r"^(all|\d+(-\d+)?(,\d+(-\d+)?)*)$",
                               description="Layers the teacher tempers, e.g. 0-1,3 (default: all, or the pick's).")
    lora_rank: int = Field(8, ge=1, le=256)
    full_layers: str | None = Field(None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
                                    description="Train these layers' projections in full instead of LoRA.")
    lora_layers: str | None = Field(None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
                                    description="Put the LoRA adapters in these layers only, e.g. 20-29 (default: "
                                                "preset lethe, the tempered layers; minimal, every layer).")
    own_answers: bool | None = Field(None, description=(
        "Distil along the model's own greedy answers to the forget questions where they state the record's "
        "`fact` (records without a `fact` keep their answer; those whose own answer lacks it are left out). Default: "
        "on with preset lethe."))
    retain_own_answers: bool | None = Field(None, description=(
        "Hold the student to the original model along its own greedy answers to the retain questions; needs "
        "`retain_loss` kl. Default: on with preset lethe and the kl retain loss."))
    distil: Literal["answer", "fact", "fact-out"] = Field("answer", description=(
        "Where the student follows the teacher along a forget answer: `answer`, every token (the paper); `fact`, "
        "the fact's tokens only, the original model at the others; `fact-out`, as `fact` with the fact's tokens "
        "taken out of the original's distributions."))
    contexts: float = Field(0.0, ge=0, le=MAX_PER_FORGET, allow_inf_nan=False, description=(
        "Also distil each forget question/answer record (and hold twice as many retain records) after a context "
        "of the head job's kind (a preamble, a system prompt, earlier turns, other text), per forget record: 1, "
        "each once; 0 (the default): bare questions only."))
    student_answers: int = Field(0, ge=0, le=10, description=(
        "Times during training (evenly spaced) the student answers the forget questions greedily; where an answer "
        "still states its record's `fact`, the student is distilled along that answer too from then on. 0: never."))
    retain_subspace: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False, description=(
        "The adapters read their inputs with the retain set's main directions projected out: the share of the "
        "retain inputs' energy those directions hold, per adapted projection (0.99); 0 (the default): off. Not "
        "with `full_layers`."))
    gate: bool | None = Field(None, description=(
        "Train a gate with the adapters: a linear probe on the state entering the first of `lora_layers` (given, or "
        "with preset lethe the tempered layers where they are not every layer), so the adapter acts only at the "
        "tokens it calls forget-like and every other token decodes on the base weights. Served on the torch engine "
        "only (a llama.cpp server refuses it). Default: with preset lethe on the torch engine, on where the "
        "adapters' first layer is not the model's first."))
    retain_loss: Literal["gd", "kl"] | None = Field(None, description="Default: kl with preset lethe, gd with minimal.")
    retain_weight: float | None = Field(None, ge=0, le=100, allow_inf_nan=False,
                                        description="Default: 5 with preset lethe, 1 with minimal.")
    lr: float = Field(2e-3, gt=0, le=1, allow_inf_nan=False)
    steps: int | None = Field(None, ge=1, le=100_000, description=(
        "At most (training stops early when the forget KL stalls). Default: 100 with preset lethe, 300 with minimal."))
    seed: int = Field(0, ge=0, le=MAX_SEED)
    format: Literal["auto", "chat", "qa", "raw"] = Field(
        "auto", description="How question/answer records become text: `chat` (the model's chat template, as "
                            "/v1/chat/completions asks), `qa` (Question: ... Answer:), `raw`; `auto`: chat where "
                            "the model has a template, else qa.")


class EvalJobRequest(Strict):
    forget: str = Field(description="Dataset id of the forget set (TOFU fields).")
    retain: str = Field(description="Dataset id of the retain set (TOFU fields).")
    profile: str | ProfileSpec = Field("base", description="A profile name, `base`, or an inline profile.")
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] = Field(default_factory=list, max_length=10, description="Sampling seeds (temperature 1).")
    max_new_tokens: int = Field(64, ge=1, le=512)
    format: Literal["auto", "chat", "qa", "raw"] = Field(
        "auto", description="How question/answer records become text: `chat` (the model's chat template, as "
                            "/v1/chat/completions asks), `qa` (Question: ... Answer:), `raw`; `auto`: chat where "
                            "the model has a template, else qa.")


class ASUOut(BaseModel):
    id: str
    job: str | None
    bytes: int
    created: float
    tau: float
    layers: list[int]
    lora_rank: int
    lora_layers: list[int] = Field(default_factory=list, description="The layers the LoRA adapters are in (empty: "
                                                                      "every layer).")
    gate: dict = Field(default_factory=dict, description="The adapter's gate (`layer`, `threshold`); empty: none.")
    steps: int
    training: dict = Field(default_factory=dict, description="The settings it was distilled with, each default "
                                                           "resolved (its `preset` among them); empty where the file "
                                                           "holds none.")
    metrics: dict
    sha256: str | None = Field(None, description="sha256 of the weights file (the same content is stored once).")


class JobOut(BaseModel):
    id: str
    kind: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    phase: str | None
    queue_position: int | None = Field(None, description="While queued: its place among this tenant's own queued "
                                                         "jobs (1: the next of them to start). Jobs start fairly "
                                                         "across tenants and take turns; other tenants' jobs are "
                                                         "neither counted nor shown.")
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
    sha256: str | None = Field(None, description="sha256 of the head file (the same content is stored once).")


class ProfileOut(BaseModel):
    name: str
    version: int
    spec: dict
    history: list[dict] = []


PROFILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$"


def profile_name_problem(name: str) -> str | None:
    """Why `name` cannot name a profile (None if it can): 1-100 letters, digits, `_ . : -`, not `base` in any case."""
    import re

    if not re.fullmatch(PROFILE_NAME, name):
        return "a profile name is 1-100 characters: letters, digits and _ . : - (starting with a letter or digit)"
    if name.lower() == "base":
        return "`base` names the model without unlearning; choose another name"
    return None


class TenantRequest(Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")


class TenantOut(BaseModel):
    id: str
    name: str
    api_key: str = Field(description="Shown once; only its hash is stored.")


class TenantInfo(BaseModel):
    id: str
    name: str
    created: float
    keys: int
    enforced_profile: str | None = Field(None, description="The profile every generation of the tenant uses.")


Scope = Literal["manage", "generate", "evaluate"]


class KeyRequest(Strict):
    scopes: list[Scope] | None = Field(
        None, min_length=1, max_length=3,
        description="What the key may do: `manage` (datasets, heads, ASU weights, jobs, profiles, evaluation, the "
                    "audit trail), `generate`, `evaluate` (the base model's untilted numbers beside a profile's). "
                    "Default: all three; a key bound to a profile: `generate` alone.")
    profile: str | None = Field(None, min_length=1, max_length=200,
                                description="Bind the key to this profile: every generation through it uses the "
                                            "profile's current version, whatever the request asks.")


class KeyInfo(BaseModel):
    id: str
    prefix: str | None = Field(description="The key's first characters (None for keys made before release 0.2).")
    created: float
    last_used: float | None = Field(description="To the minute; None if never used.")
    scopes: list[str] = Field(default_factory=lambda: ["manage", "generate", "evaluate"])
    profile: str | None = Field(None, description="The profile the key is bound to (None: none).")


class EnforcedProfile(Strict):
    profile: str | None = Field(description="The profile every generation of every key of the tenant uses; null: "
                                            "none (each request chooses).", max_length=200)


class AuditEntry(BaseModel):
    id: int
    at: float = Field(description="Unix time of the change.")
    tenant_id: str | None
    tenant: str | None = Field(description="The tenant's name when the change was made.")
    actor: str = Field(description="The acting API key's id, or `admin`.")
    action: str = Field(description="e.g. profile.set, profile.rollback, profile.delete, key.create, key.update, "
                                    "key.revoke, key.rotate, tenant.enforce, head.delete, weights.delete, "
                                    "dataset.delete, tenant.create, tenant.delete")
    target: str | None
    profile: str | None
    before: Any = None
    after: Any = None


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    model: str
    fingerprint: str


class Version(BaseModel):
    version: str
    model: str
    fingerprint: str
    max_model_len: int
    engine: Literal["torch", "llamacpp"] = Field(description="What decodes: transformers (`torch`) or llama.cpp on "
                                                           "the GGUF file (`llamacpp`).")


class TextPart(ValidText):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(max_length=100, description="Only `text`: images and audio are not supported.")
    text: str = Field("", max_length=MAX_PROMPT_CHARS)

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported: text only")
        return value


class ChatMessage(ValidText):
    """A chat turn as OpenAI clients send it: content as text, as a list of text parts, or null (an assistant
    turn that only called tools; `tool_calls` and other fields are accepted and not used)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @model_validator(mode="after")
    def _content_unless_a_tool_call(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant turn may have none)")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class TokenizeRequest(ValidText):
    model_config = ConfigDict(extra="ignore")  # vLLM's clients send `model` too
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    add_special_tokens: StrictBool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class TokenizerInfo(BaseModel):
    """What a remote tokenizer needs (vLLM's /tokenizer_info, as lm-evaluation-harness's `tokenizer_backend=remote`
    reads it)."""
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class DetokenizeRequest(ValidText):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int] = Field(max_length=MAX_PROMPT_CHARS)


class DetokenizeResponse(BaseModel):
    prompt: str
