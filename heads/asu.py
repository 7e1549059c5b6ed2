"""ASU (Attention Smoothing Unlearning): self-distillation towards a tempered-attention teacher.

Teacher: the frozen model with attention at temperature tau in chosen layers (heads.attention).
Student: the same base plus LoRA adapters (peft) on every attention and MLP projection
(`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`, rank 8 by default: the projections
carry what attention reads and writes, and rank 8 keeps the file a few percent of the base).
Loss: KL(teacher || student) over the vocabulary at the forget set's answer positions, plus a
weighted retain loss on the retain set: `gd` (NLL of the retain answers) or `kl` (KL to the
original model). The teacher is frozen, so its distributions are computed once, before training.

The weights file holds only the adapter tensors (safetensors) and metadata: base fingerprint,
tau, layers, rank, target modules, steps and metrics. Loading checks fingerprint, shapes and
finite values. Adapters are added to the served model in place (`attach`), so the base tensors
are shared, never copied; rows of one batch may use different adapters (peft's `adapter_names`).
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from heads.attention import parse_layers, tempered, use_tempered_attention
from heads.head import BaseMismatch, HeadFileError, parse_info, read_lethe_file
from heads.io import atomic_write
from heads.records import Example, encode_example, examples

FORMAT = "lethe-asu-lora"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ASUConfig:
    tau: float = 16.0  # on the demo, tau = 4 barely changes the teacher's answers; 16 breaks them
    layers: str | None = None  # "0-1,3"; None: every layer
    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = TARGETS
    full_layers: str | None = None  # "0-1": train these layers' projections fully instead of LoRA adapters
    retain_loss: str = "gd"  # gd | kl
    retain_weight: float = 1.0
    lr: float = 2e-3
    steps: int = 300
    batch_size: int = 8
    check_every: int = 25
    patience: int = 4  # checks without a 1% fall of the forget KL before stopping
    seed: int = 0


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
    steps: int = 0
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format: str = FORMAT
    format_version: int = 1


def _batch(tokenizer, exs: list[Example], device):
    """Right-padded ids, mask, and per example the positions that predict its completion."""
    enc = [encode_example(tokenizer, e) for e in exs]
    width = max(len(ids) for ids, _ in enc)
    ids = torch.full((len(enc), width), tokenizer.pad_token_id or 0)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    spans = []
    for r, (seq, n_prompt) in enumerate(enc):
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, :len(seq)] = 1
        spans.append((n_prompt - 1, len(seq) - 1))
    return ids.to(device), mask.to(device), spans


def _answer_logits(model, ids, mask, spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at answer positions, next tokens), each example's positions concatenated."""
    positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    rows = torch.cat([torch.full((b - a,), r, device=ids.device) for r, (a, b) in enumerate(spans)])
    cols = torch.cat([torch.arange(a, b, device=ids.device) for a, b in spans])
    return logits[rows, cols].float(), ids[rows, cols + 1]


class _LoRA:
    """The student as LoRA adapters (peft) on the base."""

    def __init__(self, model, info: "ASUInfo"):
        from peft import get_peft_model

        self.model = get_peft_model(model, lora_config(info))
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def original(self):
        return self.model.disable_adapter()

    def tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.model).items()}

    def restore(self) -> None:
        self.model.unload()  # the LoRA layers come out again; the base modules are back in place


_LAYER = __import__("re").compile(r"layers\.(\d+)\.")


class _FullLayers:
    """The student as the base with the projections of some layers trained in full; kept as deltas."""

    def __init__(self, model, targets, layers: list[int]):
        self.model = model
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and n.rsplit(".", 1)[-1] in targets and (k := _LAYER.search(n)) and int(k.group(1)) in layers}
        if not self.modules:
            raise ValueError("full_layers: no projection of those layers found")
        self.originals = {n: m.weight.detach().clone() for n, m in self.modules.items()}
        model.requires_grad_(False)
        self.params = [m.weight.requires_grad_(True) for m in self.modules.values()]

    @contextmanager
    def original(self):
        trained = {n: m.weight.data for n, m in self.modules.items()}
        for n, m in self.modules.items():
            m.weight.data = self.originals[n]
        try:
            yield
        finally:
            for n, m in self.modules.items():
                m.weight.data = trained[n]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{n}.delta": (m.weight.detach() - self.originals[n]).cpu().contiguous() for n, m in self.modules.items()}

    def restore(self) -> None:
        for n, m in self.modules.items():
            m.weight.data = self.originals[n]
            m.weight.requires_grad_(False)


def lora_config(info: ASUInfo):
    from peft import LoraConfig

    return LoraConfig(r=info.lora_rank, lora_alpha=info.lora_alpha, target_modules=list(info.target_modules),
                      lora_dropout=0.0, bias="none")


def train_asu(lm, forget: list[dict], retain: list[dict], cfg: ASUConfig | None = None, progress: bool = True,
              on_progress=None) -> tuple[dict[str, torch.Tensor], ASUInfo]:
    """Distil LoRA adapters; returns (adapter tensors, info). `lm.model` is left as it was."""
    cfg = cfg or ASUConfig()
    if not forget:
        raise ValueError("forget: the forget set is empty")
    if not retain:
        raise ValueError("retain: the retain set is empty")
    if cfg.retain_loss not in ("gd", "kl"):
        raise ValueError(f"retain_loss: {cfg.retain_loss!r} is not gd or kl")
    from peft import PeftModel

    if isinstance(lm.model, PeftModel) or any("lora_" in n for n, _ in lm.model.named_parameters()):
        raise ValueError("train ASU on the base model, not on one with adapters attached")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    started = time.perf_counter()
    model, tok, device = lm.model, lm.tokenizer, lm.device
    layers = parse_layers(cfg.layers, model.config.num_hidden_layers)
    use_tempered_attention(model)
    fx, rx = examples(forget), examples(retain)
    # The teacher never changes: its answer distributions are computed once.
    teacher = []
    with torch.no_grad(), tempered(model, cfg.tau, layers):
        for i in range(0, len(fx), 32):
            ids, mask, spans = _batch(tok, fx[i:i + 32], device)
            logits, _ = _answer_logits(model, ids, mask, spans)
            sizes = [b - a for a, b in spans]
            teacher += list(torch.log_softmax(logits, -1).to(torch.float16).split(sizes))
    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=cfg.tau, layers=layers, lora_rank=cfg.lora_rank,
                   lora_alpha=cfg.lora_alpha, target_modules=list(cfg.target_modules), training=asdict(cfg))
    if cfg.full_layers is not None:
        info.mode = "full"
        info.full_layers = parse_layers(cfg.full_layers, model.config.num_hidden_layers)
        student = _FullLayers(model, cfg.target_modules, info.full_layers)
    else:
        student = _LoRA(model, info)
    peft_model = student.model
    try:
        peft_model.train()
        opt = torch.optim.AdamW(student.params, lr=cfg.lr, weight_decay=0.0)

        def forget_kl(idx: list[int]) -> torch.Tensor:
            ids, mask, spans = _batch(tok, [fx[i] for i in idx], device)
            student, _ = _answer_logits(peft_model, ids, mask, spans)
            t = torch.cat([teacher[i] for i in idx]).float()
            return F.kl_div(torch.log_softmax(student, -1), t, log_target=True, reduction="batchmean")

        def retain_term(idx: list[int]) -> torch.Tensor:
            ids, mask, spans = _batch(tok, [rx[i] for i in idx], device)
            student, target = _answer_logits(peft_model, ids, mask, spans)
            if cfg.retain_loss == "gd":
                return F.cross_entropy(student, target)
            with torch.no_grad(), student.original():
                original, _ = _answer_logits(peft_model, ids, mask, spans)
            return F.kl_div(torch.log_softmax(student, -1), torch.log_softmax(original, -1), log_target=True,
                            reduction="batchmean")

        def full_forget_kl() -> float:
            with torch.no_grad():
                peft_model.eval()
                values = [float(forget_kl(list(range(i, min(i + 32, len(fx)))))) for i in range(0, len(fx), 32)]
                peft_model.train()
            return sum(values) / len(values)

        best, stale, history, step = full_forget_kl(), 0, [], 0
        history.append((0, best))
        bar = tqdm(range(cfg.steps), desc="distilling", disable=not progress, leave=False)
        for step in bar:
            f_idx = rng.sample(range(len(fx)), min(cfg.batch_size, len(fx)))
            r_idx = rng.sample(range(len(rx)), min(cfg.batch_size, len(rx)))
            kl, ret = forget_kl(f_idx), retain_term(r_idx)
            loss = kl + cfg.retain_weight * ret
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(kl=f"{kl.item():.3f}", retain=f"{ret.item():.3f}")
            if on_progress is not None:
                on_progress((step + 1) / cfg.steps)
            if (step + 1) % cfg.check_every == 0:
                current = full_forget_kl()
                history.append((step + 1, current))
                if current < best * 0.99:
                    best, stale = current, 0
                else:
                    stale += 1
                    if stale >= cfg.patience:
                        break
        peft_model.eval()
        tensors = student.tensors()
    finally:
        student.restore()  # the model is the base again
    info.steps = step + 1
    info.metrics = {"seconds": round(time.perf_counter() - started, 2), "forget_kl_start": round(history[0][1], 4),
                    "forget_kl_end": round(history[-1][1], 4),
                    "forget_kl_history": [[s, round(v, 5)] for s, v in history],
                    "adapter_parameters": sum(v.numel() for v in tensors.values())}
    return tensors, info


def save_asu(path: Path, tensors: dict[str, torch.Tensor], info: ASUInfo) -> None:
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata={"lethe": json.dumps(asdict(info))}))


MAX_RANK = 256  # the training API's bound: a file may not claim more
MAX_ALPHA = 4096.0
MAX_MAGNITUDE = 1e3  # an adapter value beyond this is no trained adapter (they are well below 1)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


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
        else:
            out[f"base_model.model.{name}.lora_A.weight"] = (info.lora_rank, n_in)
            out[f"base_model.model.{name}.lora_B.weight"] = (n_out, info.lora_rank)
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
    if not 1 < info.tau <= 1000:
        raise HeadFileError(f"{path}: metadata tau: must be in (1, 1000], got {info.tau}")
    if not info.target_modules or not set(info.target_modules) <= set(TARGETS):
        raise HeadFileError(f"{path}: metadata target_modules: must be a non-empty subset of {list(TARGETS)}")
    for name in ("layers", "full_layers"):
        bad = [i for i in getattr(info, name) if not 0 <= i < n_layers]
        if bad:
            raise HeadFileError(f"{path}: metadata {name}: layers {bad[:3]} do not exist (the model has {n_layers})")
    if info.mode == "full" and not info.full_layers:
        raise HeadFileError(f"{path}: metadata full_layers: a full-layer file names its layers")
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
        if t.dtype not in _FLOATS:
            raise HeadFileError(f"{path}: {name} has dtype {t.dtype}, not float32, float16 or bfloat16")
        if t.numel() and float(t.abs().max()) > MAX_MAGNITUDE:
            raise HeadFileError(f"{path}: {name} holds values beyond {MAX_MAGNITUDE:g} in magnitude")


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
    try:
        return _attach(model, name, tensors, info)
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
    result = set_peft_model_state_dict(model, tensors, adapter_name=name)
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
        model.delete_adapter(name)


@contextmanager
def adapters(model, names: list[str] | None):
    """Rows decode with their own adapter (`__base__`: none), in one forward pass."""
    from peft import PeftModel

    if names is None or not isinstance(model, PeftModel):
        yield
        return
    with model.base_model._enable_peft_forward_hooks(adapter_names=names):
        yield
