"""TOFU-style evaluation of a profile (the base model, or a head with its settings).

Metrics, as open-unlearning computes them (see shared/REFERENCE.md):
* ROUGE-L recall of greedy answers (stemmer on); also on paraphrased forget questions,
  and under sampling (temperature 1, several seeds);
* answer probability p = exp(-mean token NLL);
* truth ratio TR = p_wrong / p_correct (p_correct from the paraphrased answer, p_wrong from
  the mean NLL of the perturbed answers); forget aggregate mean(min(TR, 1/TR)), retain
  aggregate mean(max(0, 1 - TR));
* forget quality: KS-test p-value of the forget TRs against a reference model's;
* model utility: harmonic mean of retain probability, ROUGE and truth ratio;
* fluency of forget answers: non-word rate (words found nowhere in the corpus), repeated
  3-gram rate, and the mean per-token NLL of the answers under the reference model.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from lethe.heads.decoding.decode import generate_chunked
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import T3Head
from lethe.heads.evaluation.metrics import rouge_l_recall
from lethe.heads.records import ask, qa_example, resolve_format
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.evaluation.scoring import completion_nll

WORD = re.compile(r"[^\W\d_]+")  # runs of letters, accented ones too ("españa" is one word)


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def corpus_vocabulary(records: list[dict]) -> set[str]:
    vocab: set[str] = set()
    for r in records:
        for v in r.values():
            for text in (v if isinstance(v, list) else [v]):
                if isinstance(text, str):
                    vocab.update(words(text))
    return vocab


def nonword_rate(answers: list[str], vocab: set[str]) -> float:
    ws = [w for a in answers for w in words(a)]
    return sum(w not in vocab for w in ws) / len(ws) if ws else 0.0


def repeated_trigram_rate(answers: list[str]) -> float:
    repeated = total = 0
    for a in answers:
        ws = words(a)
        seen: set[tuple[str, ...]] = set()
        for i in range(len(ws) - 2):
            g = tuple(ws[i:i + 3])
            repeated += g in seen
            seen.add(g)
            total += 1
    return repeated / total if total else 0.0


def harmonic_mean(values: list[float]) -> float:
    return 0.0 if any(v <= 0 for v in values) else len(values) / sum(1 / v for v in values)


@dataclass
class Profile:
    name: str
    head: T3Head | None = None
    settings: TiltSettings | None = None
    adapter: str | None = None  # the ASU adapter (attached to the model) its rows decode with, as served
    repeat_guard: int = 0  # ASU weights alone: the rows' own repeat guard, as served

    def guide(self):
        return HeadGuide.uniform(self.head, self.settings or TiltSettings()) if self.head is not None else None


@dataclass
class EvalConfig:
    max_new_tokens: int = 64
    seeds: tuple[int, ...] = (0, 1, 2)
    sample_temperature: float = 1.0
    batch_size: int = 64
    examples: int = 3  # generations kept in the report per set
    extra: dict = field(default_factory=dict)
    format: str = "auto"  # how questions are asked: heads.records.resolve_format
    check: Callable[[], None] | None = None  # called between pieces of work; a job's cancellation raises from it


def _answers(model, tokenizer, questions, profile: Profile, params: SamplingParams, batch_size: int,
             fmt: str = "qa", check=None) -> list[str]:
    return [c.text.strip() for c in generate_chunked(model, tokenizer, [ask(q, fmt, tokenizer) for q in questions], params,
                                                     batch_size, profile.guide(), check, profile.adapter,
                                                     profile.repeat_guard)]


def truth_ratios(model, tokenizer, records, profile: Profile, fmt: str = "qa") -> list[float]:
    """TR per record, under the profile's distribution."""
    para = [qa_example(r["question"], r["paraphrased_answer"], fmt, tokenizer) for r in records]
    wrong = [qa_example(r["question"], w, fmt, tokenizer) for r in records for w in r["perturbed_answer"]]
    nll_c = completion_nll(model, tokenizer, para, profile.head, profile.settings, adapter=profile.adapter)
    nll_w = completion_nll(model, tokenizer, wrong, profile.head, profile.settings, adapter=profile.adapter)
    out, k = [], 0
    for r, c in zip(records, nll_c):
        n = len(r["perturbed_answer"])
        out.append(math.exp(c - statistics.fmean(nll_w[k:k + n])))  # p_wrong / p_correct
        k += n
    return out


def answer_probability(model, tokenizer, records, profile: Profile, fmt: str = "qa") -> float:
    ex = [qa_example(r["question"], r["answer"], fmt, tokenizer) for r in records]
    return statistics.fmean(math.exp(-x) for x in completion_nll(model, tokenizer, ex, profile.head, profile.settings,
                                                                 adapter=profile.adapter))


def set_metrics(lm, records, profile: Profile, cfg: EvalConfig, paraphrased: bool) -> dict:
    model, tok = lm.model, lm.tokenizer
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    fmt = resolve_format(tok, cfg.format)
    answers = _answers(model, tok, [r["question"] for r in records], profile, greedy, cfg.batch_size, fmt, cfg.check)
    if cfg.check:
        cfg.check()
    out = {"rouge": statistics.fmean(rouge_l_recall(r["answer"], a) for r, a in zip(records, answers)),
           "prob": answer_probability(model, tok, records, profile, fmt)}
    if cfg.check:
        cfg.check()
    trs = truth_ratios(model, tok, records, profile, fmt)
    if cfg.check:
        cfg.check()
    out["truth_ratios"] = trs
    sampled_rouge, sampled_answers = [], []
    for seed in cfg.seeds:
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.sample_temperature, seed=seed)
        s = _answers(model, tok, [r["question"] for r in records], profile, params, cfg.batch_size, fmt, cfg.check)
        sampled_rouge.append(statistics.fmean(rouge_l_recall(r["answer"], a) for r, a in zip(records, s)))
        sampled_answers += s
    out["rouge_sampled"] = statistics.fmean(sampled_rouge) if sampled_rouge else None
    if paraphrased:
        para = _answers(model, tok, [r["paraphrased_question"] for r in records], profile, greedy, cfg.batch_size,
                        fmt, cfg.check)
        out["rouge_paraphrased"] = statistics.fmean(rouge_l_recall(r["answer"], a) for r, a in zip(records, para))
    out["_answers"], out["_sampled_answers"] = answers, sampled_answers
    out["examples"] = [{"question": r["question"], "answer": r["answer"], "generated": a}
                       for r, a in zip(records[:cfg.examples], answers)]
    return out


def evaluate(lm, forget: list[dict], retain: list[dict], profile: Profile, reference=None,
             vocab: set[str] | None = None, cfg: EvalConfig | None = None, reference_trs: list[float] | None = None) -> dict:
    """The report for one profile. `reference` is a loaded retain-only model (for forget quality and NLL)."""
    cfg = cfg or EvalConfig()
    vocab = vocab if vocab is not None else corpus_vocabulary(forget + retain)
    f = set_metrics(lm, forget, profile, cfg, paraphrased=True)
    r = set_metrics(lm, retain, profile, cfg, paraphrased=False)
    report = {"profile": profile.name, "settings": profile.settings.as_dict() if profile.settings else None,
              "forget": {}, "retain": {}}
    for name, m in (("forget", f), ("retain", r)):
        trs = m.pop("truth_ratios")
        agg = statistics.fmean(min(t, 1 / t) for t in trs) if name == "forget" else \
            statistics.fmean(max(0.0, 1 - t) for t in trs)
        report[name] = {k: v for k, v in m.items() if not k.startswith("_")} | {"truth_ratio": agg}
        if name == "forget":
            forget_trs = trs
    report["model_utility"] = harmonic_mean([report["retain"]["prob"], report["retain"]["rouge"],
                                             report["retain"]["truth_ratio"]])
    fl = report["forget"]
    fl["nonword_rate"] = nonword_rate(f["_answers"], vocab)
    fl["repeated_3gram_rate"] = repeated_trigram_rate(f["_answers"])
    if f["_sampled_answers"]:
        fl["nonword_rate_sampled"] = nonword_rate(f["_sampled_answers"], vocab)
        fl["repeated_3gram_rate_sampled"] = repeated_trigram_rate(f["_sampled_answers"])
    if reference is not None or reference_trs is not None:
        from scipy.stats import ks_2samp

        if reference_trs is None:
            reference_trs = truth_ratios(reference.model, reference.tokenizer, forget, Profile("reference"),
                                         resolve_format(reference.tokenizer, cfg.format))
        report["forget_quality"] = float(ks_2samp(forget_trs, reference_trs).pvalue)
    if reference is not None:
        ref_fmt = resolve_format(reference.tokenizer, cfg.format)
        gen = [qa_example(rec["question"], a, ref_fmt, reference.tokenizer) for rec, a in zip(forget, f["_answers"]) if a]
        nll = completion_nll(reference.model, reference.tokenizer, gen) if gen else []
        fl["reference_nll"] = statistics.fmean(nll) if nll else None
    report["forget_truth_ratios"] = forget_trs
    return report


PLOTTED = [("forget", "rouge", "forget ROUGE-L"), ("forget", "rouge_paraphrased", "forget ROUGE (para.)"),
           ("retain", "rouge", "retain ROUGE-L"), (None, "forget_quality", "forget quality"),
           (None, "model_utility", "model utility"), ("forget", "nonword_rate", "forget non-words"),
           ("forget", "repeated_3gram_rate", "forget rep. 3-grams")]


def plot_reports(reports: list[dict], path) -> None:
    """One group of bars per metric, one bar per profile, written to a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lethe.heads.io import atomic_write

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(1, len(reports))
    for i, rep in enumerate(reports):
        values = [(rep.get(section) or {}).get(key) if section else rep.get(key) for section, key, _ in PLOTTED]
        ax.bar([j + i * width for j in range(len(PLOTTED))], [v if v is not None else 0 for v in values],
               width, label=rep["profile"])
    ax.set_xticks([j + width * (len(reports) - 1) / 2 for j in range(len(PLOTTED))], [p[2] for p in PLOTTED],
                  rotation=20, ha="right")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("Lethe evaluation")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
