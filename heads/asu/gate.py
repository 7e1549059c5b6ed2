"""ASU's gate: the adapter acts only at the tokens whose context is forget-like, decided inside the model.

ASU adapters in layers L and up (`lora_layers`) move every answer a little: on SmolLM2 the best ungated adapters
kept 0.67 of the retain answers identical to the base model's. The gate is a linear probe (logistic regression) on
the hidden state entering layer L, the first adapted layer, so what it reads is the base model's own state whatever
the adapters do. It is trained on the positions that predict forget answers (label 1) against those that predict
retain answers (label 0): each set's own answers, the model's greedy answer and `samples` sampled answers per
question (so it also fires along the paths sampling takes). At serving, a pre-hook on layer L computes, per token,
`g = [sigmoid(w . h + b) > threshold]`, and every LoRA output of the adapter (`lora_B`) is multiplied by `g`: a
token the gate leaves off decodes on the base weights exactly, and so does its cached key and value.

The decision where the answer starts latches: a row whose gate is on at the prompt's last position (the one that
predicts the answer's first token) keeps the adapter on for its whole answer (`set_latched`, kept per row by the
decode loop), because the student's own answer soon turns to text the gate never saw, and a gate that went off there
let the answer come back to the fact on the base weights. Elsewhere the gate decides token by token.

The gate is two tensors in the adapter's own file (`lethe_gate.weight`, `lethe_gate.bias`) and `ASUInfo.gate`
(`{"layer", "threshold"}`); `heads.asu.weights` installs it with the adapter and never merges a gated adapter.
"""

from __future__ import annotations

import random
import weakref

import torch
import torch.nn.functional as F

WEIGHT, BIAS = "lethe_gate.weight", "lethe_gate.bias"


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers (`model.model.layers` on Llama-like models, under peft's wrappers too)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module):
            return module
    raise ValueError("gate: the model has no list of decoder layers")


# ---- training ----------------------------------------------------------------------------------------------------

def layer_states(lm, exs, layer: int, batch: int = 16) -> torch.Tensor:
    """The hidden states entering decoder layer `layer` at the positions that predict each example's completion
    (those ASU distils at: `heads.asu.distill._batch`), stacked (n, hidden) in float32."""
    from lethe.heads.asu.distill import _batch

    out = []
    for i in range(0, len(exs), batch):
        ids, mask, spans = _batch(lm.tokenizer, exs[i:i + batch], lm.device)
        with torch.no_grad():
            hidden = lm.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[layer]
        out += [hidden[r, max(a, 0):b].float().cpu() for r, (a, b) in enumerate(spans)]
    return torch.cat(out) if out else torch.zeros((0, lm.model.config.hidden_size))


def fit(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3, max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression with both classes weighted alike and an L2 penalty, on centred and scaled states
    (LBFGS); returns (weight, bias) that apply to the raw states."""
    mean = x.mean(0)
    scale = float((x - mean).std()) or 1.0
    xs = (x - mean) / scale
    pos = float(y.sum())
    weights = torch.where(y > 0, len(y) / (2 * max(pos, 1.0)), len(y) / (2 * max(len(y) - pos, 1.0)))
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (weights * F.binary_cross_entropy_with_logits(xs @ w + b, y, reduction="none")).mean() + l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    weight = (w.detach() / scale).contiguous()
    return weight, (b.detach() - weight @ mean).reshape(1).contiguous()


def _with_answers(lm, records: list[dict], fmt: str, samples: int, seed: int, memo: dict | None = None) -> list[dict]:
    """The records, and per question the model's greedy answer (from `memo` where training decoded it already:
    `heads.asu.teacher.greedy_answers`) and `samples` sampled answers (T=1, top-p 0.95)."""
    from lethe.heads.asu.teacher import greedy_answers, sampled_answers

    qa = [r for r in records if "question" in r]
    said = greedy_answers(lm, qa, fmt, memo=memo) + [a for k in range(samples)
                                                      for a in sampled_answers(lm, qa, fmt, seed + k)]
    return records + [r | {"answer": a} for r, a in zip(qa * (samples + 1), said) if a]


def train_gate(lm, forget: list[dict], retain: list[dict], layer: int, fmt: str, threshold: float = 0.5,
               samples: int = 2, seed: int = 0, max_positions: int = 40_000,
               memo: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(the gate's tensors, its metrics) for adapters from decoder layer `layer` on, on the base model `lm`
    (`memo`: greedy answers training decoded already, by question)."""
    from lethe.heads.records import examples

    fx = examples(_with_answers(lm, forget, fmt, samples, seed, memo), fmt, lm.tokenizer)
    rx = examples(_with_answers(lm, retain, fmt, samples, seed + 100, memo), fmt, lm.tokenizer)
    f, r = layer_states(lm, fx, layer), layer_states(lm, rx, layer)
    rng = random.Random(seed)
    f, r = (s[sorted(rng.sample(range(len(s)), max_positions))] if len(s) > max_positions else s for s in (f, r))
    weight, bias = fit(torch.cat([f, r]), torch.cat([torch.ones(len(f)), torch.zeros(len(r))]))
    on = lambda s: round(float(((s @ weight + bias).sigmoid() > threshold).float().mean()), 4)  # noqa: E731
    return {WEIGHT: weight, BIAS: bias}, {"layer": layer, "threshold": threshold, "samples": samples,
                                         "positions": {"forget": len(f), "retain": len(r)},
                                         "on_forget": on(f), "on_retain": on(r)}


def layer_of(lora_layers: list[int]) -> int:
    """The gate's layer for adapters in `lora_layers`: the first of them."""
    if not lora_layers:
        raise ValueError("gate: needs lora_layers (the gate reads the state entering the first adapted layer)")
    return min(lora_layers)


# ---- serving -----------------------------------------------------------------------------------------------------

class _State:
    """Per peft model: each gated adapter's hooks, its gate values of the current forward pass, and (under per-row
    routing) the rows of each adapter."""

    def __init__(self):
        self.handles: dict[str, list] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[int]] | None = None
        self.latched: torch.Tensor | None = None  # (B,) rows whose gate stays on whatever it reads (`set_latched`)


_GATED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def gated(model, name: str) -> bool:
    state = _GATED.get(model)
    return state is not None and name in state.handles


def install(model, name: str, tensors: dict[str, torch.Tensor], gate: dict) -> None:
    """Hook adapter `name`'s gate into the (peft) model: a pre-hook on its gate layer, and on each of its `lora_B`
    modules a hook that multiplies the output by the gate."""
    from lethe.heads.asu.weights import _lora_layers

    state = _GATED.setdefault(model, _State())
    layer = decoder_layers(model)[int(gate["layer"])]
    param = next(layer.parameters())
    weight = tensors[WEIGHT].to(param.device, torch.float32)
    bias = tensors[BIAS].to(param.device, torch.float32)
    threshold = float(gate["threshold"])

    def compute(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        on = (hidden.float() @ weight + bias).sigmoid() > threshold
        if state.latched is not None:
            on = on | state.latched[:, None]
        state.values[name] = on.to(hidden.dtype)[..., None]

    def apply(module, args, output):
        g = state.values.get(name)
        if g is None:
            return output
        if state.rows is not None:  # peft routes this adapter's rows alone through it
            g = g[state.rows[name]]
        return output * g

    handles = [layer.register_forward_pre_hook(compute, with_kwargs=True)]
    handles += [m.lora_B[name].register_forward_hook(apply) for m in _lora_layers(model, name)]
    state.handles[name] = handles


def set_rows(model, rows: list[str] | None) -> None:
    """The adapter of each row of the next forward passes (None: every row uses the active adapter); each adapter's
    rows are found here once, not in every adapted projection of every step."""
    state = _GATED.get(model)
    if state is not None:
        state.rows = None if rows is None else {n: [i for i, m in enumerate(rows) if m == n] for n in set(rows)}


def set_latched(model, latched: list[bool] | None) -> None:
    """The rows of the next forward passes whose gate is latched on (None or none: the gate reads every token)."""
    state = _GATED.get(model)
    if state is not None:
        device = next(model.parameters()).device
        state.latched = torch.tensor(latched, device=device) if latched and any(latched) else None


def last_on(model, names: list[str]) -> list[bool | None]:
    """Per row, adapter `names[i]`: whether its gate was on at the row's last position in the model's last forward
    pass, the position whose logits come next (None: the row's adapter has no gate). Read right after that pass."""
    state = _GATED.get(model)
    values = state.values if state is not None else {}
    last = {n: values[n][:, -1, 0].gt(0).tolist() for n in set(names) if n in values}  # one read per adapter
    return [last[n][i] if n in last else None for i, n in enumerate(names)]


def remove(model, name: str) -> None:
    state = _GATED.get(model)
    if state is None or name not in state.handles:
        return
    for h in state.handles.pop(name):
        h.remove()
    state.values.pop(name, None)


def strip(model) -> None:
    """Every gate hook out of `model` and its modules, whoever installed it: a deep copy of a model carries its
    hooks (bound to the original's state), so a copy made for a job is stripped before it trains or serves."""
    for name in list(getattr(_GATED.get(model), "handles", {})):
        remove(model, name)
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, "__qualname__", "").startswith("install.")]:
                del hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
