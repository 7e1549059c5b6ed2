"""ASU (Attention Smoothing Unlearning): self-distillation towards a tempered-attention teacher.

Teacher: the frozen model with attention at temperature tau in chosen layers (heads.asu.attention).
Student: the same base plus LoRA adapters (peft) on every attention and MLP projection
(`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`, rank 8 by default: the projections
carry what attention reads and writes, and rank 8 keeps the file a few percent of the base).
Loss: KL(teacher || student) over the vocabulary at the forget set's answer positions, plus a
weighted retain loss on the retain set: `gd` (NLL of the retain answers) or `kl` (KL to the
original model). The teacher is frozen, so its distributions are computed once, before training.
The result is the adapter tensors and their `ASUInfo` (heads.asu.weights: the file and serving).
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lethe.heads.asu.attention import parse_layers, tempered, use_tempered_attention
from lethe.heads.asu.subspace import complement, fold, input_covariances, kept_share, projected
from lethe.heads.asu.teacher import names_fact, stating_fact
from lethe.heads.asu.weights import _LAYER, TARGETS, ASUInfo, expected_tensors, lora_config, projection_shapes
from lethe.heads.decoding.decode import right_padded
from lethe.heads.records import Example, encode_example, examples, resolve_format
from lethe.heads.t3.contexts import MAX_PER_FORGET, context_counts, context_examples, draw_contexts


@dataclass
class ASUConfig:
    tau: float = 16.0  # on the demo, tau = 4 barely changes the teacher's answers; 16 breaks them
    layers: str | None = None  # "0-1,3"; None: every layer
    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = TARGETS
    full_layers: str | None = None  # "0-1": train these layers' projections fully instead of LoRA adapters
    lora_layers: str | None = None  # "20-29": LoRA adapters in these layers only (None: every layer)
    retain_loss: str = "gd"  # gd | kl
    retain_weight: float = 1.0
    lr: float = 2e-3
    steps: int = 300
    batch_size: int = 8
    check_every: int = 25
    patience: int = 4  # checks without a 1% fall of the forget KL before stopping
    seed: int = 0
    format: str = "auto"  # how question/answer records become text: heads.records.resolve_format
    # distil along the model's own greedy answers where they state the record's `fact` (heads.asu.teacher's
    # own_answers), instead of the record's sentence, whose fact tokens the model may not expect at all
    own_answers: bool = False
    # where the model's own answers state none of the facts: distil along the set's answers (a preset's default)
    # instead of failing (asked for)
    own_answers_fallback: bool = False
    # hold the student to the original along the model's own greedy answers to the retain questions (the text it
    # generates and drifts on), instead of the retain set's sentences; needs retain_loss kl
    retain_own_answers: bool = False
    # where the student follows the teacher along the forget answers: "answer", at every token (the paper), or
    # "fact", at the fact's tokens only (the record's `fact`, else its content words: heads.asu.teacher's
    # token_roles), the original model at the others, so the words around a fact stay the model's own
    # "fact-out": as "fact", and the fact's tokens taken out of the original's distributions at the other positions
    # (renormalised), so an answer that makes a detour ("... is the city of") is not taught the fact after it
    distil: str = "answer"
    # a share of the forget and retain question/answer records is trained a second time after a context of the
    # head job's kind (heads.t3.contexts: a preamble, a system prompt, earlier turns, other text): per forget record
    # (1: each once) and heads.t3.contexts.RETAIN_PER_FORGET times as many retain records; 0: bare questions only
    contexts: float = 0.0
    # times during training (evenly spaced) the student answers the forget questions greedily; where its answer still
    # states the record's fact, it is distilled along that answer too from then on (the teacher and, with
    # distil="fact", the original read that answer): the student learns to leave the fact out along the paths it
    # takes itself, not only along the base model's answer ("... is the city of Paris" after "... is" was pushed)
    student_answers: int = 0
    # the adapters read their inputs with the retain set's main directions projected out (heads.asu.subspace): the
    # share of the retain inputs' energy those directions hold (0.99), per adapted projection; 0: off
    retain_subspace: float = 0.0
    # a gate (heads.asu.gate) on the state entering the first of `lora_layers`, trained after the adapters on the
    # forget against the retain answers (the sets', the model's greedy one and `gate_samples` sampled ones per
    # question): the adapter acts only at the tokens it calls forget-like; needs lora_layers
    gate: bool = False
    gate_threshold: float = 0.5
    gate_samples: int = 2


def _batch(tokenizer, exs: list[Example], device):
    """Right-padded ids, mask, and per example the positions that predict its completion."""
    enc = [encode_example(tokenizer, e) for e in exs]
    ids, mask = right_padded([seq for seq, _ in enc], tokenizer.pad_token_id or 0)
    return ids.to(device), mask.to(device), [(n_prompt - 1, len(seq) - 1) for seq, n_prompt in enc]


def _answer_logits(model, ids, mask, spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at answer positions, next tokens), each example's positions concatenated."""
    positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    rows = torch.cat([torch.full((b - a,), r, device=ids.device) for r, (a, b) in enumerate(spans)])
    cols = torch.cat([torch.arange(a, b, device=ids.device) for a, b in spans])
    return logits[rows, cols].float(), ids[rows, cols + 1]


def _targets(model, tok, exs: list[Example], device, context) -> list[torch.Tensor]:
    """Per example, the log-distributions at its answer positions (float16) of the model under `context()`."""
    out = []
    with torch.no_grad(), context():
        for i in range(0, len(exs), 32):
            ids, mask, spans = _batch(tok, exs[i:i + 32], device)
            logits, _ = _answer_logits(model, ids, mask, spans)
            out += list(torch.log_softmax(logits, -1).to(torch.float16).split([b - a for a, b in spans]))
    return out


DISTIL = ("answer", "fact", "fact-out")


def forget_targets(model, tok, exs: list[Example], records: list[dict], cfg: ASUConfig, layers, device
                   ) -> list[torch.Tensor]:
    """What the student learns along each forget example's answer: the tempered teacher's log-distributions, or
    with `distil="fact"` the teacher's at the fact's positions and the original model's at the others (`fact-out`:
    the original's without the fact's tokens)."""
    use_tempered_attention(model)  # tempering works through this attention function only (idempotent)
    teacher = _targets(model, tok, exs, device, lambda: tempered(model, cfg.tau, layers))
    if cfg.distil == "answer":
        return teacher
    original = _targets(model, tok, exs, device, nullcontext)
    masks = fact_masks(tok, exs, records, [len(t) for t in teacher])
    if cfg.distil == "fact-out":
        original = [_without_fact(o, tok, ex, m) for o, ex, m in zip(original, exs, masks)]
    return [torch.where(m[:, None].to(t.device), t, o) for t, o, m in zip(teacher, original, masks)]


def _without_fact(logprobs: torch.Tensor, tok, ex: Example, mask: torch.Tensor) -> torch.Tensor:
    """`logprobs` (one per answer position) with the tokens the answer's fact consists of taken out, renormalised."""
    seq, n_prompt = encode_example(tok, ex)
    following = torch.tensor(seq[n_prompt:n_prompt + len(mask)])
    fact = following[mask[:len(following)]].unique()
    if not len(fact):
        return logprobs
    out = logprobs.float()
    out[:, fact.to(out.device)] = float("-inf")
    return torch.log_softmax(out, -1).clamp_min(torch.finfo(torch.float16).min).to(logprobs.dtype)


def fact_masks(tok, exs: list[Example], records: list[dict], sizes: list[int]) -> list[torch.Tensor]:
    """Per example, which of its `size` answer positions predict a token of its fact (`distil="fact"`); a record
    without a question and an answer (a bare text) is all fact."""
    from lethe.heads.asu.teacher import token_roles

    masks = []
    for ex, r, size in zip(exs, records, sizes):
        if "question" in r and "answer" in r:
            roles = token_roles(tok, ex, str(r["answer"]).strip(), r.get("fact"))
            fact = [role == "content" for role in roles][:size]
            masks.append(torch.tensor(fact + [False] * (size - len(fact))))
        else:
            masks.append(torch.ones(size, dtype=torch.bool))
    return masks


def _with_contexts(forget: list[dict], retain: list[dict], fx: list[Example], rx: list[Example], cfg: ASUConfig,
                   fmt: str, tok) -> tuple[list[dict], list[Example], list[Example]]:
    """The forget and retain examples, each list followed by records of its set asked after a context
    (`cfg.contexts`); the forget records are extended alike, so a forget example keeps its record's `fact`."""
    contexts = draw_contexts(forget + retain, seed=cfg.seed)
    n_forget, n_retain = context_counts(forget, cfg.contexts)
    f_after, _, f_sources = context_examples(forget, contexts, n_forget, fmt, tok, seed=cfg.seed)
    r_after, _, _ = context_examples(retain, contexts, n_retain, fmt, tok, seed=cfg.seed + 1)
    return forget + [forget[i] for i in f_sources], fx + f_after, rx + r_after


def _retain_subspace(model, tok, fx: list[Example], rx: list[Example], info: ASUInfo, energy: float, device
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """({adapted projection: P}, what the projections keep) for `ASUConfig.retain_subspace` (empty when 0)."""
    if not energy:
        return {}, {}
    names = [k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
             for k in expected_tensors(info, projection_shapes(model)) if k.endswith(".lora_A.weight")]

    def batches(exs: list[Example]):
        return (_batch(tok, exs[i:i + 16], device)[:2] for i in range(0, len(exs), 16))

    retain = input_covariances(model, batches(rx), names)
    forget = input_covariances(model, batches(fx), names)
    projections, directions = {}, []
    for n in names:
        projections[n], k = complement(retain[n], energy)
        directions.append(k / retain[n].shape[0])
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return projections, {"energy": energy, "directions_removed": mean(directions),
                         "retain_energy_kept": mean([kept_share(retain[n], projections[n]) for n in names]),
                         "forget_energy_kept": mean([kept_share(forget[n], projections[n]) for n in names])}


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


def train_asu(lm, forget: list[dict], retain: list[dict], cfg: ASUConfig | None = None, progress: bool = True,
              on_progress=None, memo: dict | None = None) -> tuple[dict[str, torch.Tensor], ASUInfo]:
    """Distil LoRA adapters; returns (adapter tensors, info). `lm.model` is left as it was. `memo`: the base
    model's greedy answers by question decoded already in this format (the teacher diagnostic's), kept and
    added to."""
    cfg = cfg or ASUConfig()
    if not forget:
        raise ValueError("forget: the forget set is empty")
    if not retain:
        raise ValueError("retain: the retain set is empty")
    if cfg.retain_loss not in ("gd", "kl"):
        raise ValueError(f"retain_loss: {cfg.retain_loss!r} is not gd or kl")
    if cfg.distil not in DISTIL:
        raise ValueError(f"distil: {cfg.distil!r} is not one of {', '.join(DISTIL)}")
    if not 0 <= cfg.student_answers <= 10:
        raise ValueError(f"student_answers: {cfg.student_answers} is not between 0 and 10")
    if not 0 <= cfg.retain_subspace < 1:
        raise ValueError(f"retain_subspace: {cfg.retain_subspace} is not in [0, 1)")
    if cfg.retain_subspace and cfg.full_layers is not None:
        raise ValueError("retain_subspace: projects LoRA adapters' inputs; full_layers trains no adapter")
    if cfg.gate and (cfg.lora_layers is None or cfg.full_layers is not None):
        raise ValueError("gate: needs lora_layers (the gate reads the state entering the first adapted layer)")
    if not 0 < cfg.gate_threshold < 1:
        raise ValueError(f"gate_threshold: {cfg.gate_threshold} is not in (0, 1)")
    if not 0 <= cfg.gate_samples <= 8:
        raise ValueError(f"gate_samples: {cfg.gate_samples} is not between 0 and 8")
    if not 0 <= cfg.contexts <= MAX_PER_FORGET:
        raise ValueError(f"contexts: {cfg.contexts} is not between 0 and {MAX_PER_FORGET}")
    from peft import PeftModel

    if isinstance(lm.model, PeftModel) or any("lora_" in n for n, _ in lm.model.named_parameters()):
        raise ValueError("train ASU on the base model, not on one with adapters attached")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    started = time.perf_counter()
    model, tok, device = lm.model, lm.tokenizer, lm.device
    asked_forget, asked_retain = forget, retain  # the sets as given: what the gate learns from
    layers = parse_layers(cfg.layers, model.config.num_hidden_layers)
    use_tempered_attention(model)
    fmt = resolve_format(tok, cfg.format)
    # the base model's greedy answers by question, decoded once (the diagnostic, own answers, the gate)
    said: dict[str, str] = {} if memo is None else memo
    own_answers_fell_back = False
    if cfg.own_answers:
        from lethe.heads.asu.teacher import own_answers

        stated = own_answers(lm, forget, fmt, memo=said)
        if stated:
            forget = stated
        elif not cfg.own_answers_fallback:
            raise ValueError("forget: the model's own answers state none of the forget set's facts (distil along "
                             "the set's answers: own_answers false)")
        else:  # the preset's default, not asked for: the set's own answers, as without it
            own_answers_fell_back = True
    if cfg.retain_own_answers:
        from lethe.heads.asu.teacher import greedy_answers

        if cfg.retain_loss != "kl":
            raise ValueError("retain_own_answers: needs retain_loss kl (gd would teach the model its own answers)")
        qa = [r for r in retain if "question" in r]
        own = dict(zip(map(id, qa), greedy_answers(lm, qa, fmt, memo=said)))
        # a question the model answers with nothing keeps its record's answer; other records are kept as they are
        retain = [r | {"answer": own[id(r)]} if own.get(id(r)) else r for r in retain]
    fx, rx = examples(forget, fmt, tok), examples(retain, fmt, tok)
    asked = [r for r in forget if "question" in r and names_fact(r)]
    if cfg.student_answers and not asked:
        raise ValueError("student_answers: no forget record with a question names its `fact`, which the student's "
                         "answers are searched for")
    if cfg.contexts > 0:
        forget, fx, rx = _with_contexts(forget, retain, fx, rx, cfg, fmt, tok)
    # The teacher never changes: its answer distributions are computed once.
    teacher = forget_targets(model, tok, fx, forget, cfg, layers, device)
    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=cfg.tau, layers=layers, lora_rank=cfg.lora_rank,
                   lora_alpha=cfg.lora_alpha, target_modules=list(cfg.target_modules), training=asdict(cfg))
    if cfg.lora_layers is not None:
        try:
            info.lora_layers = parse_layers(cfg.lora_layers, model.config.num_hidden_layers)
        except ValueError as e:
            raise ValueError(f"lora_{e}") from None
    projections, subspace = {}, {}
    if cfg.full_layers is not None:
        info.mode = "full"
        info.full_layers = parse_layers(cfg.full_layers, model.config.num_hidden_layers)
        student = _FullLayers(model, cfg.target_modules, info.full_layers)
    else:
        projections, subspace = _retain_subspace(model, tok, fx, rx, info, cfg.retain_subspace, device)
        student = _LoRA(model, info)
    peft_model = student.model
    stack = ExitStack()
    try:
        if projections:
            stack.enter_context(projected(peft_model, projections))
        peft_model.train()
        opt = torch.optim.AdamW(student.params, lr=cfg.lr, weight_decay=0.0)

        def forget_kl(idx: list[int]) -> torch.Tensor:
            ids, mask, spans = _batch(tok, [fx[i] for i in idx], device)
            logits, _ = _answer_logits(peft_model, ids, mask, spans)
            t = torch.cat([teacher[i] for i in idx]).float()
            return F.kl_div(torch.log_softmax(logits, -1), t, log_target=True, reduction="batchmean")

        def retain_term(idx: list[int]) -> torch.Tensor:
            ids, mask, spans = _batch(tok, [rx[i] for i in idx], device)
            logits, target = _answer_logits(peft_model, ids, mask, spans)
            if cfg.retain_loss == "gd":
                return F.cross_entropy(logits, target)
            with torch.no_grad(), student.original():
                original, _ = _answer_logits(peft_model, ids, mask, spans)
            return F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(original, -1), log_target=True,
                            reduction="batchmean")

        def full_forget_kl() -> float:
            with torch.no_grad():
                peft_model.eval()
                values = [float(forget_kl(list(range(i, min(i + 32, len(fx)))))) for i in range(0, len(fx), 32)]
                peft_model.train()
            return sum(values) / len(values)

        def add_student_answers() -> int:
            """Distil along the student's greedy answers to the forget questions that still state their fact."""
            from lethe.heads.asu.teacher import greedy_answers

            peft_model.eval()
            with torch.no_grad():
                new = stating_fact(asked, greedy_answers(lm, asked, fmt))
            peft_model.train()
            if new:
                nx = examples(new, fmt, tok)
                with student.original():
                    teacher.extend(forget_targets(peft_model, tok, nx, new, cfg, layers, device))
                fx.extend(nx)
            return len(new)

        rounds = {round(cfg.steps * k / (cfg.student_answers + 1)) for k in range(1, cfg.student_answers + 1)}
        still_stated: list[list[int]] = []  # per round: (step, forget questions whose student answer stated the fact)
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
            if step + 1 in rounds and asked:
                still_stated.append([step + 1, add_student_answers()])
                best, stale = full_forget_kl(), 0  # the new answers are not learned yet: measure from here
                history.append((step + 1, best))
            elif (step + 1) % cfg.check_every == 0:
                current = full_forget_kl()
                history.append((step + 1, current))
                if current < best * 0.99:
                    best, stale = current, 0
                else:
                    stale += 1
                    if stale >= cfg.patience:
                        break
        if history[-1][0] != step + 1:  # the last steps came after the last check: measure where training ended
            history.append((step + 1, full_forget_kl()))
        peft_model.eval()
        tensors = student.tensors()
        if projections:
            tensors = fold(tensors, projections)
    finally:
        stack.close()
        student.restore()  # the model is the base again
    gate_metrics = None
    if cfg.gate:
        from lethe.heads.asu.gate import layer_of, train_gate

        gate_started = time.perf_counter()
        gate_tensors, gate_metrics = train_gate(lm, asked_forget, asked_retain, layer_of(info.lora_layers), fmt,
                                                cfg.gate_threshold, cfg.gate_samples, cfg.seed, memo=said)
        tensors |= gate_tensors
        info.gate = {"layer": gate_metrics["layer"], "threshold": cfg.gate_threshold}
        gate_metrics["seconds"] = round(time.perf_counter() - gate_started, 2)
    info.steps = step + 1
    info.metrics = {"seconds": round(time.perf_counter() - started, 2), "forget_kl_start": round(history[0][1], 4),
                    "forget_kl_end": round(history[-1][1], 4),
                    "forget_kl_history": [[s, round(v, 5)] for s, v in history],
                    "adapter_parameters": sum(v.numel() for v in tensors.values()),
                    "examples": {"forget": len(fx), "retain": len(rx)}}
    if own_answers_fell_back:
        info.metrics["own_answers"] = "the model's own answers state none of the facts: the set's answers"
    if subspace:
        info.metrics["retain_subspace"] = subspace
    if gate_metrics:
        info.metrics["gate"] = gate_metrics
    if rounds:
        info.metrics["student_answers_stating_fact"] = {"questions": len(asked), "rounds": still_stated}
    return tensors, info
