"""ASU weights: the file, its complete check against a base model, and attaching it to the served model.

The weights file holds only the adapter tensors (safetensors) and metadata (`ASUInfo`): base fingerprint,
tau, layers, rank, target modules, steps and metrics. `check_asu` refuses anything that could not attach
exactly (a tensor that fits no module, a wrong shape or dtype, bounds, magnitudes) before the model is
touched. Adapters are added to the served model in place (`attach`, all or nothing), so the base tensors are
shared, never copied; rows of one batch may use different adapters (peft's `adapter_names`). A batch whose rows
all use one adapter decodes on the base weights with that adapter merged in (a copy of the adapted projections,
kept for the last `LETHE_ASU_MERGED` adapters, default 1; 0: peft's plain path), so it costs what the base costs.
An adapter with a gate (heads.asu.gate) acts token by token through hooks, so it is never merged.
"""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lethe.heads.io import atomic_write
from lethe.heads.t3.head import BaseMismatch, HeadFileError, parse_info, read_lethe_file

FORMAT = "lethe-asu-lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class ASUInfo:
    base_fingerprint: str
    tau: float
    layers: list[int]
    lora_rank: int
    lora_alpha: int
    target_modules: list[str]
    mode: str = "lora"  # lora | full (the changed projection weights, as deltas)
    full_layers: list[int] = field(default_factory=list)
    lora_layers: list[int] = field(default_factory=list)  # the layers LoRA adapts; empty: every layer
    gate: dict = field(default_factory=dict)  # {"layer", "threshold"} of its gate (heads.asu.gate); empty: none
    steps: int = 0
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format: str = FORMAT
    format_version: int = 1


def default_repeat_guard(info: ASUInfo) -> int:
    """The repeat guard (its n; 0: off) of rows decoding with these weights alone unless told otherwise: on for gated
    weights, whose rows it guards only where the gate lets the adapter act, so retain answers keep the base model's;
    off for ungated ones, where it would act on every answer (it changed retain answers on SmolLM2)."""
    return 3 if info.gate else 0


def lora_config(info: ASUInfo):
    from peft import LoraConfig

    return LoraConfig(r=info.lora_rank, lora_alpha=info.lora_alpha, target_modules=list(info.target_modules),
                      layers_to_transform=list(info.lora_layers) or None, lora_dropout=0.0, bias="none")


def save_asu(path: Path, tensors: dict[str, torch.Tensor], info: ASUInfo) -> None:
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata={"lethe": json.dumps(asdict(info))}))


MAX_RANK = 256  # the training API's bound: a file may not claim more
MAX_ALPHA = 4096.0
MAX_MAGNITUDE = 1e3  # an adapter value beyond this is no trained adapter (they are well below 1)


def projection_shapes(model) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the base model's projections ASU may adapt, with or without peft layers:
    the table an uploaded file is checked against."""
    shapes = {}
    for name, module in model.named_modules():
        if ".lora_" in name or not isinstance(module, torch.nn.Linear):
            continue
        name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        if name.rsplit(".", 1)[-1] in TARGETS:
            shapes[name] = (module.out_features, module.in_features)
    return shapes


def expected_tensors(info: ASUInfo, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, ...]]:
    """The exact tensor names and shapes a file with this metadata must hold for a model with `shapes`."""
    def layer(name: str) -> int | None:
        found = _LAYER.search(name)
        return int(found.group(1)) if found else None

    targets = set(info.target_modules)
    out: dict[str, tuple[int, ...]] = {}
    for name, (n_out, n_in) in shapes.items():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        if info.mode == "full":
            if layer(name) in info.full_layers:
                out[f"{name}.delta"] = (n_out, n_in)
        elif not info.lora_layers or layer(name) in info.lora_layers:
            out[f"base_model.model.{name}.lora_A.weight"] = (info.lora_rank, n_in)
            out[f"base_model.model.{name}.lora_B.weight"] = (n_out, info.lora_rank)
    if info.gate:
        from lethe.heads.asu.gate import BIAS, WEIGHT

        hidden = next(n_in for name, (_, n_in) in shapes.items() if name.endswith("q_proj"))
        out |= {WEIGHT: (hidden,), BIAS: (1,)}
    return out


def check_asu(path, tensors: dict[str, torch.Tensor], info: ASUInfo, shapes: dict[str, tuple[int, int]],
              n_layers: int) -> None:
    """Refuse (HeadFileError) anything that could not attach exactly: metadata out of bounds, a tensor that fits
    no module of this base (or one missing), a wrong shape or dtype, values of absurd magnitude. Runs before a
    single tensor is allocated in the model, so a refused file never touches the served model."""
    if info.format != FORMAT or info.format_version != 1:
        raise HeadFileError(f"{path}: format {info.format!r} v{info.format_version} is not {FORMAT} v1")
    if info.mode not in ("lora", "full"):
        raise HeadFileError(f"{path}: metadata mode: {info.mode!r} is not lora or full")
    if not 1 <= info.lora_rank <= MAX_RANK:
        raise HeadFileError(f"{path}: metadata lora_rank: must be in [1, {MAX_RANK}], got {info.lora_rank}")
    if not 0 < info.lora_alpha <= MAX_ALPHA:
        raise HeadFileError(f"{path}: metadata lora_alpha: must be in (0, {MAX_ALPHA:g}], got {info.lora_alpha}")
    if not 0 <= info.steps <= 1_000_000:
        raise HeadFileError(f"{path}: metadata steps: must be in [0, 1000000], got {info.steps}")
    if not info.layers:
        raise HeadFileError(f"{path}: metadata layers: names no layer")
    if not 1 < info.tau <= 1000:
        raise HeadFileError(f"{path}: metadata tau: must be in (1, 1000], got {info.tau}")
    if not info.target_modules or not set(info.target_modules) <= set(TARGETS):
        raise HeadFileError(f"{path}: metadata target_modules: must be a non-empty subset of {list(TARGETS)}")
    for name in ("layers", "full_layers", "lora_layers"):
        bad = [i for i in getattr(info, name) if not 0 <= i < n_layers]
        if bad:
            raise HeadFileError(f"{path}: metadata {name}: layers {bad[:3]} do not exist (the model has {n_layers})")
    if info.mode == "full" and not info.full_layers:
        raise HeadFileError(f"{path}: metadata full_layers: a full-layer file names its layers")
    if info.gate:
        _check_gate(path, info)
    expected = expected_tensors(info, shapes)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise HeadFileError(f"{path}: {len(unexpected)} tensors fit no module of this model: {unexpected[:3]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise HeadFileError(f"{path}: {len(missing)} tensors are missing: {missing[:3]}")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise HeadFileError(f"{path}: {name} has shape {tuple(t.shape)}, this model needs {shape}")
        if t.numel() and float(t.abs().max()) > MAX_MAGNITUDE:
            raise HeadFileError(f"{path}: {name} holds values beyond {MAX_MAGNITUDE:g} in magnitude")


def _check_gate(path, info: ASUInfo) -> None:
    gate = info.gate
    if not isinstance(gate, dict) or set(gate) != {"layer", "threshold"}:
        raise HeadFileError(f"{path}: metadata gate: must hold exactly layer and threshold")
    layer, threshold = gate["layer"], gate["threshold"]
    if info.mode != "lora" or not info.lora_layers:
        raise HeadFileError(f"{path}: metadata gate: needs a LoRA file with lora_layers")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer <= min(info.lora_layers):
        raise HeadFileError(f"{path}: metadata gate: layer must be an integer in [0, {min(info.lora_layers)}] (no "
                            f"adapter below it), got {layer!r}")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < 1:
        raise HeadFileError(f"{path}: metadata gate: threshold must be in (0, 1), got {threshold!r}")


def load_asu(path: Path, base_fingerprint: str | None = None, shapes: dict[str, tuple[int, int]] | None = None,
             n_layers: int | None = None) -> tuple[dict[str, torch.Tensor], ASUInfo]:
    """Read ASU weights; with the model's `projection_shapes` and layer count, check them completely
    (`check_asu`)."""
    tensors, raw = read_lethe_file(path, "ASU weights")
    info = parse_info(ASUInfo, raw, path)
    if info.format != FORMAT:
        raise HeadFileError(f"{path}: format {info.format!r} is not {FORMAT}")
    if base_fingerprint is not None and info.base_fingerprint != base_fingerprint:
        raise BaseMismatch(f"{path}: adapters were trained on base model {info.base_fingerprint}, "
                           f"this model is {base_fingerprint}")
    if shapes is not None:
        check_asu(path, tensors, info, shapes, n_layers)
    return tensors, info


def attach(model, name: str, tensors: dict[str, torch.Tensor], info: ASUInfo):
    """Add the adapter `name` to `model` in place (wrapping it with peft the first time); returns the model
    to decode with. The base weights are shared by every adapter.

    All or nothing: the tensors are checked against the model first, and if anything fails while the adapter
    goes in, it comes out again (and a first wrap is undone), so the model is exactly as it was."""
    from peft import PeftModel

    check_asu(name, tensors, info, projection_shapes(model), model.config.num_hidden_layers)
    wrapped = isinstance(model, PeftModel)
    if wrapped:
        restore_base(model)
    try:
        model = _attach(model, name, tensors, info)
    except BaseException:
        if wrapped:
            detach(model, name)
        else:  # the first wrap injected LoRA layers into the base modules in place: take them out again
            from peft.tuners.tuners_utils import BaseTunerLayer

            for module_name, module in list(model.named_modules()):
                if isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer"):
                    parent = model.get_submodule(module_name.rsplit(".", 1)[0]) if "." in module_name else model
                    setattr(parent, module_name.rsplit(".", 1)[-1], module.get_base_layer())
            vars(model).pop("peft_config", None)
        raise
    if info.gate:
        from lethe.heads.asu.gate import install

        try:
            install(model, name, tensors, info.gate)
        except BaseException:
            detach(model, name)
            raise
    model._lethe_state = None  # adding may change the active adapter: `adapters` sets its state again
    return model


def _attach(model, name: str, tensors: dict[str, torch.Tensor], info: ASUInfo):
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict

    config = lora_config(info) if info.mode == "lora" else _full_rank_config(model, tensors)
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
    else:
        model = get_peft_model(model, config, adapter_name=name)
    if info.mode == "full":
        _load_full_rank(model, name, tensors)
        model.eval()
        return model
    lora = {k: v for k, v in tensors.items() if not k.startswith("lethe_gate.")}
    result = set_peft_model_state_dict(model, lora, adapter_name=name)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise HeadFileError(f"adapter {name}: tensors that fit no module of this model: {missing[:3]}")
    model.eval()
    return model


def _full_rank_config(model, tensors: dict[str, torch.Tensor]):
    """Full-layer deltas served as LoRA of full rank (A = I, B = delta): exact, and batchable with others."""
    from peft import LoraConfig

    ranks = {k[: -len(".delta")]: t.shape[1] for k, t in tensors.items()}
    return LoraConfig(r=1, lora_alpha=1, target_modules=list(ranks), rank_pattern=ranks, alpha_pattern=ranks,
                      lora_dropout=0.0, bias="none")


def _load_full_rank(model, name: str, tensors: dict[str, torch.Tensor]) -> None:
    deltas = {k[: -len(".delta")]: t for k, t in tensors.items()}
    found = 0
    for module_name, module in model.named_modules():
        key = next((k for k in deltas if module_name.endswith(k)), None)
        if key is None or not hasattr(module, "lora_A") or name not in module.lora_A:
            continue
        delta = deltas[key].to(module.lora_B[name].weight)
        module.lora_A[name].weight.data = torch.eye(delta.shape[1], dtype=delta.dtype, device=delta.device)
        module.lora_B[name].weight.data = delta
        found += 1
    if found != len(deltas):
        raise HeadFileError(f"adapter {name}: {len(deltas) - found} deltas fit no module of this model")


def detach(model, name: str) -> None:
    from peft import PeftModel

    if isinstance(model, PeftModel) and name in model.peft_config:
        from lethe.heads.asu.gate import remove

        remove(model, name)
        restore_base(model)
        _MERGED.get(model, {}).pop(name, None)
        model.delete_adapter(name)
        model._lethe_state = None  # deleting may change the active adapter: `adapters` sets its state again


@contextmanager
def adapters(model, names: list[str] | None, latched: list[bool] | None = None):
    """Rows decode with their own adapter (`__base__`: none), in one forward pass.

    A batch whose rows all use one adapter, or none, runs the base layers alone: on the base weights with that
    adapter merged in (`_merged`), or as they are. Only a batch that mixes them pays for peft's per-row routing
    (`adapter_names`), which splits every adapted projection's input by adapter. The model keeps its last state
    (`_use`), so consecutive steps of one batch switch nothing. `latched`: per row, whether its gated adapter's gate
    stays on at every token (`heads.asu.gate.set_latched`)."""
    from peft import PeftModel

    if names is None or not isinstance(model, PeftModel):
        yield
        return
    from lethe.heads.asu.gate import set_latched, set_rows

    distinct = set(names)
    set_latched(model, latched)
    try:
        if len(distinct) > 1:
            _use(model, MIXED)
            set_rows(model, names)  # a gated adapter's hooks see its own rows alone
            with model.base_model._enable_peft_forward_hooks(adapter_names=names):
                yield
        else:
            _use(model, distinct.pop())
            yield
    finally:
        set_rows(model, None)
        set_latched(model, None)


MIXED = "__mixed__"


def _use(model, state: str) -> None:
    """Adapter layers off on the base weights (`__base__`), off on the weights with one adapter merged in (or, with
    merging off, on with that adapter active for every row), or on for per-row routing (`MIXED`)."""
    if getattr(model, "_lethe_state", None) == state:
        return
    base = model.base_model
    from lethe.heads.asu.gate import gated

    # a gated adapter acts token by token: its weights are never merged
    merge = state not in ("__base__", MIXED) and _keep() > 0 and not gated(model, state)
    _set_weights(model, _merged(model, state) if merge else {})
    if state == "__base__" or merge:
        base.disable_adapter_layers()
    else:
        base.enable_adapter_layers()
        if state != MIXED:
            base.set_adapter(state, inference_mode=True)
    model._lethe_state = state


# Per peft model (weakly, so a deep copy of the model carries none of it): each adapted projection's own weight, the
# one loaded, while another is swapped in; and the merged weights of the last adapters used, least recent first.
_PRISTINE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MERGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _keep() -> int:
    return max(0, int(os.environ.get("LETHE_ASU_MERGED", "1")))


def _lora_layers(model, name: str | None = None) -> list:
    from peft.tuners.lora.layer import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer) and (name is None or name in m.lora_A)]


def _merged(model, name: str) -> dict:
    """{projection: its base weight plus adapter `name`'s delta} for every projection the adapter changes."""
    cache = _MERGED.setdefault(model, OrderedDict())
    if name in cache:
        cache.move_to_end(name)
        return cache[name]
    while len(cache) >= _keep():
        cache.popitem(last=False)
    with torch.no_grad():
        original = _PRISTINE.get(model, {})
        cache[name] = {m: original.get(m, m.get_base_layer().weight.data) + m.get_delta_weight(name)
                       for m in _lora_layers(model, name)}
    return cache[name]


def _set_weights(model, weights: dict) -> None:
    """The base layers' weights: `weights[m]` for the projections it names, their own for every other."""
    original = _PRISTINE.setdefault(model, {})
    for m in _lora_layers(model):
        layer = m.get_base_layer()
        if m in weights:
            original.setdefault(m, layer.weight.data)
            layer.weight.data = weights[m]
        elif m in original:
            layer.weight.data = original.pop(m)


def unload(model):
    """The base model out of a peft model, on its own weights: peft's `unload` would keep a merged adapter's; no
    gate hook stays behind."""
    from lethe.heads.asu.gate import strip

    restore_base(model)
    strip(model)
    return model.unload()


def restore_base(model) -> None:
    """The base layers on their own weights (before the model is copied, saved, or given another adapter); the
    next `adapters` sets its state again."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        _set_weights(model, {})
        model._lethe_state = None
