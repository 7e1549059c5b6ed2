"""The T3 head: a low-rank map from a pooled hidden state to one logit per vocabulary token.

    z = W_up(W_down(pooled)) (+ bias),   W_down: d -> r,   W_up: r -> V

`W_up` starts at zero, so a token the head never saw stays neutral
(logsigmoid(0) is the same for every token). A head file is safetensors with
metadata: format version, base-model fingerprint, shapes, layer, pooling,
prompt format, the recommended profile settings, training settings, metrics and
creation time. Loading checks all of it and says exactly what does not match.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from lethe.heads.io import atomic_write
from lethe.heads.t3.pooling import window_of

FORMAT = "lethe-t3-head"
FORMAT_VERSION = 1
MAX_RANK = 1024  # the training API's bound
MAX_MAGNITUDE = 1e4  # trained heads and adapters stay far below; beyond it logits overflow in low precision


class HeadFileError(ValueError):
    """A head file that cannot be used: unreadable, malformed, non-finite, or for another base model."""


class BaseMismatch(HeadFileError):
    """The head was trained on another base model."""


class T3Head(torch.nn.Module):
    """The head, plus an optional sequence-level probe: P(forget | pooled), which gates the tilt."""

    def __init__(self, d: int, vocab: int, rank: int, bias: bool = False, probe: bool = True, window: int = 0):
        """`window`: the head reads states pooled over the last `window` positions (`heads.t3.pooling`; 0: the
        whole context's mean)."""
        super().__init__()
        self.window = window
        self.down = torch.nn.Linear(d, rank, bias=False)
        self.up = torch.nn.Linear(rank, vocab, bias=bias)
        torch.nn.init.zeros_(self.up.weight)
        if bias:
            torch.nn.init.zeros_(self.up.bias)
        self.probe = torch.nn.Linear(d, 1) if probe else None

    @property
    def rank(self) -> int:
        return self.down.out_features

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V): one logit per token."""
        return self.up(self.down(pooled.to(self.down.weight.dtype)))

    def forget_probability(self, pooled: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N,): how forget-like each context is, in [0, 1] (1 without a probe)."""
        if self.probe is None:
            return torch.ones(pooled.shape[0], device=pooled.device)
        # the probe is trained like the head, with retain = 1: its logit says "retain"
        return torch.sigmoid(-self.probe(pooled.to(self.probe.weight.dtype))[:, 0].float())

    def logits_at(self, pooled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, d), (B, k) -> (B, k): the logits of k tokens per row."""
        u = self.down(pooled.to(self.down.weight.dtype))
        z = torch.einsum("br,bkr->bk", u, self.up.weight[tokens])
        return z + self.up.bias[tokens] if self.up.bias is not None else z

    def decode_terms(self, pooled: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """For decoding: (forget probability (B, 1), or None without a probe; logits of k tokens per row (B, k)).

        Few operations, since this runs at every step: the down projection and the probe are one matmul
        (`_decoding_weights`), and only the k tokens' rows of W_up are read.
        """
        down, bias, up, up_bias = self._decoding_weights(pooled.device)
        h = torch.addmm(bias, pooled.to(down.dtype), down.T)  # (B, r + 1): u, then the probe's "forget" logit
        z = torch.bmm(F.embedding(tokens, up), h.unsqueeze(-1)).squeeze(-1)  # up has a zero column for the probe
        if up_bias is not None:
            z = z + F.embedding(tokens, up_bias).squeeze(-1)
        return (h[:, self.rank:].sigmoid() if self.probe is not None else None), z

    def _decoding_weights(self, device: torch.device | str | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """W_down and the negated probe as one (r + 1, d) matrix with its bias, W_up with a zero column, on
        `device` (default: the head's own), so a head trained on the CPU decodes beside a model on a GPU.

        Built once and rebuilt only when a weight changes in place (training) or another device asks, so a
        serving head pays nothing.
        """
        params = list(self.parameters())
        device = torch.device(device) if device is not None else params[0].device
        versions = [(p._version, p.data_ptr(), p.device) for p in params] + [device]
        cached = getattr(self, "_decoding", None)
        if cached is not None and cached[0] == versions:
            return cached[1]
        with torch.no_grad():
            rows, bias = [self.down.weight], [self.down.weight.new_zeros(self.rank)]
            if self.probe is not None:  # the probe's logit says "retain"; negated, its sigmoid is P(forget)
                rows.append(-self.probe.weight)
                bias.append(-self.probe.bias)
            down = torch.cat(rows)
            up = torch.cat([self.up.weight, self.up.weight.new_zeros(self.up.out_features, len(rows) - 1)], 1)
            up_bias = None if self.up.bias is None else self.up.bias[:, None].clone()
            weights = tuple(None if w is None else w.to(device) for w in (down, torch.cat(bias), up, up_bias))
        self._decoding = (versions, weights)
        return weights

    def token_logit(self, pooled: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """(N, d), (N,) -> (N,): the logit of one token per row, without forming the (N, V) matrix."""
        u = self.down(pooled.to(self.down.weight.dtype))
        z = (u * self.up.weight[token]).sum(-1)
        return z + self.up.bias[token] if self.up.bias is not None else z


@dataclass
class HeadInfo:
    """Everything a head file says about itself, beside the tensors."""

    base_fingerprint: str
    d: int
    vocab: int
    rank: int
    layer: int = -1  # -1: the last layer, after the final norm
    pooling: str = "mean"  # `heads.t3.pooling`: "mean" or "window:W"
    prompt_format: str = "Question: {question}\nAnswer:"
    profile: dict = field(default_factory=dict)  # recommended settings: T, lam, ...
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION


def save_head(path: Path, head: T3Head, info: HeadInfo) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    meta = {"lethe": json.dumps(info.__dict__)}
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_lethe_file(path: Path, what: str) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors, Lethe metadata JSON) of a safetensors file; HeadFileError says what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise HeadFileError(f"{path}: no such {what} file")
    try:
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("lethe")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise HeadFileError(f"{path}: not a safetensors file ({e})") from None
    if raw is None:
        raise HeadFileError(f"{path}: no Lethe metadata; not a Lethe {what} file")
    for name, t in tensors.items():
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise HeadFileError(f"{path}: {name} has dtype {t.dtype}, not float32, float16 or bfloat16")
        if not torch.isfinite(t).all():
            raise HeadFileError(f"{path}: {name} holds NaN or Inf values")
        if t.numel() and float(t.abs().max()) > MAX_MAGNITUDE:
            raise HeadFileError(f"{path}: {name} holds values beyond {MAX_MAGNITUDE:g} in magnitude")
    return tensors, raw


def parse_info(cls, raw: str, path: Path):
    """The metadata dataclass `cls` from a file's JSON metadata: every field of the right type, no unknown
    field (pydantic checks the types, so a list where a dict belongs is refused here, not at first use)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise HeadFileError(f"{path}: metadata is not readable JSON") from None
    if not isinstance(data, dict):
        raise HeadFileError(f"{path}: metadata is not a JSON object")
    from lethe.heads.records import text_problem

    problem = text_problem(data, max_depth=16)
    if problem:
        raise HeadFileError(f"{path}: metadata {problem}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise HeadFileError(f"{path}: unknown metadata fields {unknown[:5]}")
    try:
        return TypeAdapter(cls).validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"]) or "metadata"
        raise HeadFileError(f"{path}: metadata {where}: {err['msg']}") from None


def load_head(path: Path, base_fingerprint: str | None = None, vocab: int | None = None,
              d: int | None = None) -> tuple[T3Head, HeadInfo]:
    """Read and check a head file; `base_fingerprint`, `vocab`, `d` are what the serving model has."""
    from lethe.heads.t3.guide import TiltSettings

    tensors, raw = read_lethe_file(path, "head")
    info = parse_info(HeadInfo, raw, path)
    try:  # the recommended settings are what a profile gets by default: checked now, not at first use
        TiltSettings.from_dict(info.profile)
    except (TypeError, ValueError) as e:
        raise HeadFileError(f"{path}: metadata profile: {e}") from None
    if info.format != FORMAT or not 1 <= info.format_version <= FORMAT_VERSION:
        raise HeadFileError(f"{path}: format {info.format} v{info.format_version} is not {FORMAT} <= v{FORMAT_VERSION}")
    if not 1 <= info.rank <= MAX_RANK:
        raise HeadFileError(f"{path}: metadata rank: must be in [1, {MAX_RANK}], got {info.rank}")
    if info.layer != -1:
        raise HeadFileError(f"{path}: metadata layer: Lethe serves heads on the last layer (-1), not {info.layer}")
    try:
        window = window_of(info.pooling)
    except ValueError as e:
        raise HeadFileError(f"{path}: metadata {e}") from None
    expected = {"down.weight": (info.rank, info.d), "up.weight": (info.vocab, info.rank)}
    if "up.bias" in tensors:
        expected["up.bias"] = (info.vocab,)
    if "probe.weight" in tensors or "probe.bias" in tensors:
        expected |= {"probe.weight": (1, info.d), "probe.bias": (1,)}
    unexpected = set(tensors) - set(expected)
    if unexpected:
        raise HeadFileError(f"{path}: unexpected tensors {sorted(unexpected)}")
    for name, shape in expected.items():
        if name not in tensors:
            raise HeadFileError(f"{path}: tensor {name} is missing")
        if tuple(tensors[name].shape) != shape:
            raise HeadFileError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, metadata says {shape}")
    if base_fingerprint is not None and info.base_fingerprint != base_fingerprint:
        raise BaseMismatch(f"{path}: head was trained on base model {info.base_fingerprint}, "
                           f"this model is {base_fingerprint}")
    if vocab is not None and info.vocab != vocab:
        raise BaseMismatch(f"{path}: head has vocabulary {info.vocab}, the model has {vocab}")
    if d is not None and info.d != d:
        raise BaseMismatch(f"{path}: head expects hidden size {info.d}, the model has {d}")
    head = T3Head(info.d, info.vocab, info.rank, bias="up.bias" in tensors, probe="probe.weight" in tensors,
                  window=window)
    head.load_state_dict(tensors)
    return head.eval().requires_grad_(False), info
