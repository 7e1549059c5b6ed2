"""Turning one step's logits into next tokens: per-row penalties, temperature, top-k, top-p, min-p and seed.

Pure tensor functions. Every setting is a tensor with one entry per batch row,
so rows with different settings decode in one batch. Temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


MAX_NEW_TOKENS = 1_000_000
MAX_TOP_K = 1_000_000
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: below this, logits / temperature overflows; decode greedily
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_LOGPROBS = 20  # alternatives per position (vLLM's default max_logprobs; OpenAI's chat allows 20)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability (after temperature); 0: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token the answer already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the answer
    logprobs: int | None = None  # each new token's log-probability and this many likeliest others' (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (None: none)
    untilted_logprobs: bool = False  # also the base model's own log-probabilities at the same positions
    min_new_tokens: int = 0  # vLLM's min_tokens: the end-of-text token cannot be chosen before this many

    def __post_init__(self):
        """Checked wherever they are made (HTTP, CLI, Python), so no value reaches a batch that fails it."""
        # max_new_tokens 0: the prompt alone (its log-probabilities, say), nothing generated
        for name, low, high in (("max_new_tokens", 0, MAX_NEW_TOKENS), ("top_k", 0, MAX_TOP_K),
                                ("min_new_tokens", 0, MAX_NEW_TOKENS),
                                ("logprobs", 0, MAX_LOGPROBS), ("prompt_logprobs", 0, MAX_LOGPROBS)):
            value = getattr(self, name)
            if value is None and name.endswith("logprobs"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        for name, ok in (("temperature", lambda v: 0 <= v <= MAX_TEMPERATURE), ("top_p", lambda v: 0 < v <= 1),
                         ("min_p", lambda v: 0 <= v <= 1), ("presence_penalty", lambda v: -2 <= v <= 2),
                         ("frequency_penalty", lambda v: -2 <= v <= 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{name}: out of range, got {value!r}")
        if self.temperature < GREEDY_BELOW:  # as vLLM: a temperature this small is greedy decoding
            self.temperature = 0.0
        if len(self.stop) > MAX_STOPS or any(not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")

def penalize(logits: torch.Tensor, answers: list[list[int]], presence: list[float],
             frequency: list[float]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties on each row's tokens so far: logit - presence [count > 0]
    - frequency * count. Rows without penalties are left as they are (no copy when none has any)."""
    rows = [i for i, (p, f) in enumerate(zip(presence, frequency)) if (p or f) and answers[i]]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        counts = torch.bincount(torch.tensor(answers[i], device=logits.device), minlength=logits.size(-1))
        counts = counts[: logits.size(-1)].to(logits.dtype)
        logits[i] -= presence[i] * (counts > 0).to(logits.dtype) + frequency[i] * counts
    return logits


def below_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """(B, V) mask of the tokens whose probability is below min_p (B,) times the row's best token's."""
    logits = logits.float()
    return logits < logits.amax(-1, keepdim=True) + torch.log(min_p[:, None])


def logits_to_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (nucleus), then min-p; rows independent.

    logits (B, V); temperature (B,) > 0; top_k (B,) with 0 meaning off; top_p (B,) in (0, 1]; min_p (B,) in
    [0, 1], 0 (or None for every row) meaning off.
    """
    logits = logits.float() / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):  # min-p: relative to the best token, whatever top-k/p keep
        logits = logits.masked_fill(below_min_p(logits, min_p), float("-inf"))
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; the best token always stays, whatever
    remove |= (before >= top_p[:, None]) & (ranks > 0)  # top_p is (a top_p that rounds to 0 in float32 included)
    kept = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator], failed: dict[int, Exception] | None = None,
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row: argmax where temperature is 0, else a draw from that row's own generator.

    With `failed`, a row whose draw raises (probabilities that are not finite, say) is recorded there
    (row index -> exception) instead of failing the call; the other rows are drawn as usual."""
    tokens = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = logits_to_probs(logits[rows], temperature[rows], top_k[rows], top_p[rows],
                                None if min_p is None else min_p[rows])
        for j, row in enumerate(sampled):
            try:
                tokens[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
            except RuntimeError as e:
                if failed is None:
                    raise
                failed[row] = e
    return tokens


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
