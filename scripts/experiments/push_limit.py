"""Session 36: the cap's push limit (`max_push`) on the demo, offline. For heads of several training seeds and the
default profile with `max_push` at several values (None: no limit, the profile before this setting), two scores of
how a model that never learnt the forget set would look:

* forget quality: the KS p-value of the forget set's truth ratios (paraphrased against perturbed answers) against the
  retain-only model's, as `lethe bench t3-quality` reads it;
* log-likelihood multiple choice: the share of forget records whose fact, put into the record's answer sentence, has
  the highest summed log-probability among up to four options (the fact and three others of its kind from both sets,
  chosen as `lethe bench attacks` chooses them; the raw "Question: ... Answer:" form). The retain-only model's share
  is what a model that never knew the facts gives.

Run: .venv/bin/python scripts/experiments/push_limit.py [SEED ...]   (default: 0 1 2; about 2 minutes a seed)"""
import statistics
import sys
from dataclasses import replace

from scipy.stats import ks_2samp

from lethe.heads.evaluation.evaluate import Profile, truth_ratios
from lethe.heads.evaluation.scoring import completion_nll
from lethe.heads.modelio import load_model
from lethe.heads.records import encode_example, qa_example, read_jsonl
from lethe.heads.t3.guide import PRESETS
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig
from lethe.server.bench.attacks import demo_item, options_for

ASSETS = "heads/demo/assets"
LIMITS = (None, 3.0, 4.0, 5.0)


def main(seeds: list[int]) -> None:
    lm, ref = load_model(f"{ASSETS}/model"), load_model(f"{ASSETS}/retain_model")
    forget, retain = read_jsonl(f"{ASSETS}/forget.jsonl"), read_jsonl(f"{ASSETS}/retain.jsonl")
    items = [demo_item(r) for r in forget]
    golds: dict[str, list[str]] = {}
    for item in items + [demo_item(r) for r in retain]:
        golds.setdefault(item["kind"], []).append(item["gold"])

    def options(item: dict) -> list[str]:  # as `lethe bench attacks` chooses them
        return options_for(item, golds[item["kind"]])

    def gold_first(model, tokenizer, profile: Profile) -> float:
        examples = [qa_example(it["question"], it["answer"].replace(it["gold"], o), "qa")
                    for it in items for o in options(it)]
        nll = completion_nll(model, tokenizer, examples, profile.head, profile.settings)
        sizes = [len(ids) - 1 - n for ids, n in (encode_example(tokenizer, e) for e in examples)]
        total = [m * n for m, n in zip(nll, sizes)]  # summed over the option's tokens, EOS excluded
        wins, k = 0, 0
        for it in items:
            opts = options(it)
            scores = total[k:k + len(opts)]
            wins += min(range(len(opts)), key=scores.__getitem__) == opts.index(it["gold"])
            k += len(opts)
        return wins / len(items)

    chance = statistics.fmean(1 / len(options(it)) for it in items)
    reference = truth_ratios(ref.model, ref.tokenizer, forget, Profile("reference"))

    def show(name: str, model, tokenizer, profile: Profile) -> None:
        trs = truth_ratios(model, tokenizer, forget, profile)
        q = statistics.quantiles(trs, n=4)
        print(f"{name:32} forget quality {ks_2samp(trs, reference).pvalue:.3g}  TR quartiles "
              f"{q[0]:.3f} {q[1]:.3f} {q[2]:.3f}  LL-MC gold first {gold_first(model, tokenizer, profile):.3f} "
              f"(chance {chance:.3f})", flush=True)

    show("retain-only model", ref.model, ref.tokenizer, Profile("reference"))
    show("full model", lm.model, lm.tokenizer, Profile("full"))
    for seed in seeds:
        head, _ = train_head(lm, forget, retain, FitConfig(gate_answers=0, seed=seed), progress=False)
        for limit in LIMITS:
            settings = replace(PRESETS["default"], max_push=limit)
            label = "no limit" if limit is None else f"max_push {limit:g}"
            show(f"head seed {seed}, {label}", lm.model, lm.tokenizer, Profile(label, head, settings))


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [0, 1, 2])
