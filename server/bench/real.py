"""`lethe bench real`: forgetting a topic a pretrained chat model knows, end to end, with fluency measured.

1. Facts from templates (`heads.evaluation.facts`); keep the items the base model answers correctly (greedy,
   through its chat template, canonical question), so every forget hit at the start is knowledge, not luck.
2. Forget: one kind of fact (capitals by default); retain: the other kinds. The head trains on every question
   template but the last (held out), in the model's own format (chat where it has a template).
3. Generate base and tilted answers to the canonical and the held-out question: greedy, and sampled at each
   temperature with top-p, over several seeds (the same seed for base and tilted).
4. Score: hit rate (the gold answer in the text), the share of retain answers identical to the base model's,
   and the fluency of forget answers: non-words (alphabetic words not in an English word list), repeated word
   3-grams, degenerate loops (a unit of 1-4 characters repeated five or more times). The base model's answers
   to questions of the forget kind it does *not* know are the fluency reference: what a model that never
   learned the fact says.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace

from lethe.heads.decoding.decode import generate_chunked
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.evaluation.evaluate import nonword_rate, repeated_trigram_rate
from lethe.heads.evaluation.facts import KINDS, hit, kind, records
from lethe.heads.evaluation.metrics import KnownWords, has_loop
from lethe.heads.records import ask, resolve_format
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig
from lethe.server.bench import shown_path


@dataclass
class RealBenchConfig:
    forget: str = "capital"
    max_new_tokens: int = 40
    temperatures: tuple[float, ...] = (0.7, 1.0)
    top_p: float = 0.9
    seeds: tuple[int, ...] = (0, 1, 2)
    limit: int | None = None  # subjects per kind (a quick run); None: all
    batch_size: int = 32
    fit: FitConfig = field(default_factory=FitConfig)
    settings: dict = field(default_factory=dict)  # tilt settings over the head's recommendation
    # further named settings to compare on the same head and the same base answers ({} in a variant: the head's
    # recommendation); the report's rows name their variant, the first being "head" (`settings` above)
    variants: dict[str, dict] = field(default_factory=dict)
    # ASU beside T3: trained on the same sets at this tau (None: not run), evaluated alone ("asu") and with the
    # head under `settings` ("asu+head"); the base answers are the model's without the adapter
    asu_tau: float | None = None
    asu_steps: int = 300
    asu_layers: str | None = None  # the teacher's tempered layers (None: all)
    asu_retain_loss: str = "gd"
    asu_retain_weight: float = 1.0
    asu_own_answers: bool = False  # distil along the model's own answers (ASUConfig.own_answers)
    asu_retain_own_answers: bool = False  # the KL retain loss along the model's own retain answers
    asu_distil: str = "answer"  # where the student follows the teacher (ASUConfig.distil): answer | fact
    asu_lora_layers: str | None = None  # the layers ASU's LoRA adapts (None: all)
    asu_contexts: float = 0.0  # ASUConfig.contexts
    asu_student_answers: int = 0  # ASUConfig.student_answers
    asu_retain_subspace: float = 0.0  # ASUConfig.retain_subspace
    asu_gate: bool = False  # ASUConfig.gate
    asu_repeat_guard: int = 0  # > 0: also the variant "asu guarded", ASU alone with a repeat guard of this n
    # the "asu+head routed" variant: the adapter only where the head's probe gives P(forget | prompt) above this
    asu_adapter_above: float = 0.5
    asu_save: str | None = None  # write the trained ASU weights here (a file `lethe asu train --out` would write)
    asu_weights: str | None = None  # use these ASU weights instead of training (the asu_* training settings unused)
    # train ASU as a job naming only the sets would: the teacher's pick and this preset's settings
    # (heads.asu.presets; the asu_* training settings unused)
    asu_preset: str | None = None


def _asu_weights(lm, cfg: RealBenchConfig, forget_train: list[dict], retain_train: list[dict]):
    """ASU weights for the bench: `cfg.asu_weights` read and checked against `lm`, or trained on the bench's sets
    (and written to `cfg.asu_save`)."""
    from pathlib import Path

    from lethe.heads.asu.distill import ASUConfig, train_asu
    from lethe.heads.asu.presets import configure, record
    from lethe.heads.asu.weights import load_asu, projection_shapes, save_asu

    if cfg.asu_weights:
        return load_asu(Path(cfg.asu_weights), lm.fingerprint, projection_shapes(lm.model),
                        lm.model.config.num_hidden_layers)
    named = [r | {"fact": r["gold"]} for r in forget_train]  # the gold is the fact the own answers must state
    teacher, said = None, {}  # said: greedy answers the teacher decodes, which training reuses
    if cfg.asu_preset:
        asu_cfg, teacher = configure(lm, named, {"format": cfg.fit.format}, cfg.asu_preset, memo=said)
    else:
        asu_cfg = ASUConfig(
            tau=cfg.asu_tau, steps=cfg.asu_steps, layers=cfg.asu_layers, retain_loss=cfg.asu_retain_loss,
            retain_weight=cfg.asu_retain_weight, own_answers=cfg.asu_own_answers,
            retain_own_answers=cfg.asu_retain_own_answers, distil=cfg.asu_distil, lora_layers=cfg.asu_lora_layers,
            contexts=cfg.asu_contexts, student_answers=cfg.asu_student_answers,
            retain_subspace=cfg.asu_retain_subspace, gate=cfg.asu_gate, format=cfg.fit.format)
    tensors, info = train_asu(lm, named, retain_train, asu_cfg, progress=False, memo=said)
    if cfg.asu_preset:
        record(info, cfg.asu_preset, teacher)
    if cfg.asu_save:
        save_asu(Path(cfg.asu_save), tensors, info)
    return tensors, info


def fluency(answers: list[str], vocab) -> dict:
    return {"nonword": round(nonword_rate(answers, vocab), 4),
            "repeated_3gram": round(repeated_trigram_rate(answers), 4),
            "loops": round(sum(map(has_loop, answers)) / len(answers), 4) if answers else 0.0}


def _generate(lm, prompts: list[str], params: SamplingParams, guide, batch_size: int, asu=None,
              adapter: bool = False, guard: int = 0) -> list[str]:
    """Answers, stripped. `asu`: the model with an ASU adapter attached, used with it on (`adapter`) or off; on
    llama.cpp, the engine holding adapter `bench_asu`. `guard`: the rows' own repeat guard (ASU alone)."""
    if asu is None:
        return [c.text.strip() for c in generate_chunked(lm.model, lm.tokenizer, prompts, params, batch_size, guide)]
    # rows name the adapter, or the base weights, as the server's do (`heads.asu.weights.adapters`)
    return [c.text.strip() for c in generate_chunked(asu, lm.tokenizer, prompts, params, batch_size, guide,
                                                     adapter="bench_asu" if adapter else "__base__",
                                                     repeat_guard=guard)]


def _score(row: dict, name: str, recs: list[dict], base: list[str], tilted: list[str], vocab) -> None:
    """Hit rates of one set (and the held-out question's), retain identity or forget fluency, into `row`."""
    row[f"{name}_hits_base"] = round(statistics.fmean(hit(a, r["gold"]) for a, r in zip(base, recs)), 4)
    row[f"{name}_hits_head"] = round(statistics.fmean(hit(a, r["gold"]) for a, r in zip(tilted, recs)), 4)
    held = [i for i, r in enumerate(recs) if r["held_out"]]
    row[f"{name}_hits_head_held_out"] = round(statistics.fmean(hit(tilted[i], recs[i]["gold"]) for i in held), 4)
    if name == "retain":
        row["retain_identical"] = round(statistics.fmean(a == b for a, b in zip(base, tilted)), 4)
    else:
        row["forget_fluency_base"] = fluency(base, vocab)
        row["forget_fluency_head"] = fluency(tilted, vocab)


def run(lm, cfg: RealBenchConfig | None = None, log=print, decoder=None) -> dict:
    """`decoder`: what decodes every answer instead of `lm.model` (a `heads.decoding.llamacpp.LlamaCppModel`, the
    llama.cpp engine); the head still trains on `lm.model`'s hidden states, as the server's jobs do."""
    cfg = cfg or RealBenchConfig()
    trainer, lm = lm, (replace(lm, model=decoder) if decoder is not None else lm)  # lm: what answers
    started = time.perf_counter()
    fmt = resolve_format(lm.tokenizer, cfg.fit.format)
    vocab = KnownWords()
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    forget_kind = kind(cfg.forget)

    # 1. what the base model knows
    known: dict[str, list[str]] = {}
    unknown_answers: list[str] = []
    for k in KINDS:
        subjects = list(k.items)[: cfg.limit]
        answers = _generate(lm, [ask(k.questions[0].format(x=x), fmt, lm.tokenizer) for x in subjects], greedy, None,
                            cfg.batch_size)
        known[k.name] = [x for x, a in zip(subjects, answers) if hit(a, k.items[x])]
        if k.name == forget_kind.name:
            unknown_answers = [a for x, a in zip(subjects, answers) if not hit(a, k.items[x])]
        log(f"known: {k.name} {len(known[k.name])}/{len(subjects)}")

    # 2. train on every question template but the last
    train = slice(0, -1)
    forget_train = records(forget_kind, known[forget_kind.name], train)
    retain_train = [r for k in KINDS if k.name != forget_kind.name for r in records(k, known[k.name], train)]
    fit_started = time.perf_counter()
    head, info = train_head(trainer, forget_train, retain_train, cfg.fit, progress=False)
    train_seconds = time.perf_counter() - fit_started
    log(f"trained on {len(forget_train)} forget and {len(retain_train)} retain records in {train_seconds:.1f} s")
    settings = TiltSettings.from_dict({**info.profile, **cfg.settings})
    asu, asu_metrics = None, None
    if cfg.asu_tau is not None or cfg.asu_weights or cfg.asu_preset:
        from lethe.heads.asu.weights import attach, unload

        tensors, asu_info = _asu_weights(trainer, cfg, forget_train, retain_train)
        asu_metrics = {"steps": asu_info.steps, "tau": asu_info.tau, "layers": asu_info.layers,
                       "lora_layers": asu_info.lora_layers, "training": asu_info.training, **asu_info.metrics}
        log(f"ASU (tau {asu_info.tau:g}) {'loaded' if cfg.asu_weights else 'trained'}: {asu_info.steps} steps in "
            f"{asu_info.metrics.get('seconds')} s" + (f"; gate {asu_info.metrics['gate']}" if asu_info.gate else ""))
        if decoder is not None:  # llama.cpp: a LoRA adapter its rows name (`_generate`)
            from lethe.heads.asu.gguf import add_to_llama_cpp

            add_to_llama_cpp(decoder, "bench_asu", tensors, asu_info, trainer.model.config)
            asu = decoder
        else:
            asu = attach(lm.model, "bench_asu", tensors, asu_info)
    # each variant: (guide, whether the ASU adapter is on, its abstention reply, the rows' own repeat guard)
    chosen = {"head": settings} | {name: TiltSettings.from_dict({**info.profile, **over})
                                   for name, over in cfg.variants.items()}
    # a variant that routes (adapter_above > 0) decodes with the ASU adapter where it routes to it
    variants = {name: (HeadGuide.uniform(head, s), asu is not None and s.adapter_above > 0, s.abstain, 0)
                for name, s in chosen.items()}
    if asu is not None:
        routed = settings.replace(adapter_above=cfg.asu_adapter_above)
        variants |= {"asu": (None, True, settings.abstain, 0),
                     "asu+head": (variants["head"][0], True, settings.abstain, 0),
                     "asu+head routed": (HeadGuide.uniform(head, routed), True, settings.abstain, 0)}
        if cfg.asu_repeat_guard:
            variants["asu guarded"] = (None, True, settings.abstain, cfg.asu_repeat_guard)

    # 3. the canonical and the held-out question of every known item
    def eval_set(kinds) -> list[dict]:
        return [r | {"held_out": i == 1} for k in kinds
                for i, q in enumerate((slice(0, 1), slice(-1, None))) for r in records(k, known[k.name], q)]

    sets = {"forget": eval_set([forget_kind]), "retain": eval_set([k for k in KINDS if k.name != forget_kind.name])}
    runs = [("greedy", greedy)] + [
        (f"T={t} top_p={cfg.top_p} seed={s}", SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=t,
                                                            top_p=cfg.top_p, seed=s))
        for t in cfg.temperatures for s in cfg.seeds]
    rows, examples = [], {}
    try:
        for label, params in runs:
            _decode_and_score(lm, label, params, sets, variants, asu, cfg, fmt, vocab, rows, examples, log)
    finally:
        if decoder is not None and asu is not None:
            decoder.remove_adapter("bench_asu")
        elif asu is not None:
            unload(asu)  # the base model as it was
    if len(variants) == 1:
        examples = examples["head"]
    return {"model": shown_path(lm.path), "fingerprint": lm.fingerprint, "format": fmt, "config": asdict(cfg),
            "engine": "torch" if decoder is None else f"llamacpp ({decoder.path})",
            "known": {k: len(v) for k, v in known.items()}, "train_records": [len(forget_train), len(retain_train)],
            "train_seconds": round(train_seconds, 2), "head_metrics": info.metrics, "settings": settings.as_dict(),
            "asu": asu_metrics,
            "never_knew_fluency": fluency(unknown_answers, vocab), "never_knew_answers": len(unknown_answers),
            "rows": rows, "examples": examples, "seconds": round(time.perf_counter() - started, 1)}


def _decode_and_score(lm, label, params, sets, variants, asu, cfg, fmt, vocab, rows, examples, log) -> None:
    """One decoding (greedy, or sampled with one seed): base answers once, then each variant's; a row each."""
    prompts = {name: [ask(r["question"], fmt, lm.tokenizer) for r in recs] for name, recs in sets.items()}
    base = {name: _generate(lm, prompts[name], params, None, cfg.batch_size, asu) for name in sets}
    for variant, (guide, adapter, reply, guard) in variants.items():
        row = {"decoding": label} | ({"variant": variant} if len(variants) > 1 else {})
        for name, recs in sets.items():
            tilted = _generate(lm, prompts[name], params, guide, cfg.batch_size, asu, adapter, guard)
            _score(row, name, recs, base[name], tilted, vocab)
            if reply is not None:  # how often it abstained (on retain: false refusals)
                row[f"{name}_abstained"] = round(statistics.fmean(t == reply.strip() for t in tilted), 4)
            if label == "greedy":
                examples.setdefault(variant, {})[name] = [
                    {"question": r["question"], "base": b, "head": t}
                    for r, b, t in list(zip(recs, base[name], tilted))[:6 if variant == "head" else 20]]
        rows.append(row)
        log(f"{label} {variant}: forget hits {row['forget_hits_base']:.2f} -> {row['forget_hits_head']:.2f} "
            f"(held-out {row['forget_hits_head_held_out']:.2f}), retain identical {row['retain_identical']:.2f}, "
            f"forget loops {row['forget_fluency_head']['loops']:.2f}, repeated 3-grams "
            f"{row['forget_fluency_base']['repeated_3gram']:.3f} -> {row['forget_fluency_head']['repeated_3gram']:.3f}"
            f", non-words {row['forget_fluency_base']['nonword']:.3f} -> {row['forget_fluency_head']['nonword']:.3f}")


def markdown(report: dict) -> str:
    """The README's table: one line per decoding (sampled runs averaged over seeds)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in report["rows"]:
        groups.setdefault((row.get("variant", ""), row["decoding"].split(" seed=")[0]), []).append(row)
    variants = any("variant" in row for row in report["rows"])
    abstains = any("forget_abstained" in row for row in report["rows"])

    def mean(rows, key, sub=None):
        return statistics.fmean(r[key][sub] if sub else r[key] for r in rows)

    lines = [("| variant " if variants else "") + "| decoding | forget hits base -> head (held-out question) "
             "| retain hits base -> head | retain identical | forget loops base / head | repeated 3-grams base / head "
             "| non-words base / head |" + (" abstained forget / retain |" if abstains else ""),
             ("| --- " if variants else "") + "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if abstains else "")]
    for (variant, label), rows in groups.items():
        lines.append(
            (f"| {variant} " if variants else "") +
            f"| {label}{' (mean of ' + str(len(rows)) + ' seeds)' if len(rows) > 1 else ''} "
            f"| {mean(rows, 'forget_hits_base'):.2f} -> {mean(rows, 'forget_hits_head'):.2f} "
            f"({mean(rows, 'forget_hits_head_held_out'):.2f}) "
            f"| {mean(rows, 'retain_hits_base'):.2f} -> {mean(rows, 'retain_hits_head'):.2f} "
            f"| {mean(rows, 'retain_identical'):.2f} "
            f"| {mean(rows, 'forget_fluency_base', 'loops'):.2f} / {mean(rows, 'forget_fluency_head', 'loops'):.2f} "
            f"| {mean(rows, 'forget_fluency_base', 'repeated_3gram'):.3f} / "
            f"{mean(rows, 'forget_fluency_head', 'repeated_3gram'):.3f} "
            f"| {mean(rows, 'forget_fluency_base', 'nonword'):.3f} / {mean(rows, 'forget_fluency_head', 'nonword'):.3f} |"
            + ((f" {mean(rows, 'forget_abstained'):.2f} / {mean(rows, 'retain_abstained'):.2f} |"
                if "forget_abstained" in rows[0] else " - |") if abstains else ""))
    nk = report["never_knew_fluency"]
    lines.append(f"\nFluency of a model that never knew (the base model's greedy answers to the "
                 f"{report['never_knew_answers']} {report['config']['forget']} questions it gets wrong): loops "
                 f"{nk['loops']:.2f}, repeated 3-grams {nk['repeated_3gram']:.3f}, non-words {nk['nonword']:.3f}.")
    return "\n".join(lines) + "\n"
