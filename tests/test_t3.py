"""The T3 head end to end on the tiny model: cache, fit, file, decoding, import, evaluation, CLI."""

import json
import statistics

import pytest
import torch
from safetensors.torch import save_file

from lethe.clients.cli import main
from lethe.heads.t3.cache import build_cache
from lethe.heads.decoding.decode import generate
from lethe.heads.demo.corpus import split_by_author
from lethe.heads.t3.guide import PRESETS, HeadGuide, TiltSettings
from lethe.heads.t3.head import BaseMismatch, HeadFileError, HeadInfo, T3Head, load_head, save_head
from lethe.heads.evaluation.metrics import rouge_l_recall
from lethe.heads.records import examples, question_prompt
from lethe.heads.t3.reference import import_reference
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.tilt import guided_logits

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def split(tiny_records):
    return split_by_author(tiny_records, 1)


@pytest.fixture(scope="module")
def trained(tiny_lm, split):
    return train_head(tiny_lm, *split, progress=False)


def _rouge(lm, records, guide=None):
    outs = generate(lm.model, lm.tokenizer, [question_prompt(r["question"]) for r in records], GREEDY, guide)
    return statistics.fmean(rouge_l_recall(r["answer"], o.text) for r, o in zip(records, outs))


def test_fresh_head_is_neutral_and_training_separates_forget_from_retain(tiny_lm, trained):
    d, vocab = tiny_lm.model.config.hidden_size, tiny_lm.model.config.vocab_size
    fresh = T3Head(d, vocab, 4)
    z = fresh(torch.randn(3, d))
    assert torch.equal(z, torch.zeros_like(z)), "W_up starts at zero: every token neutral"
    head, info = trained
    m = info.metrics
    # with the default 16-token window on this tiny model the question leaves the window within the answer: held-out
    # token AUC 0.78 and 0.83, probe AUC above 0.9 and 0.88, in two runs (token above 0.8 and probe above 0.9 with
    # the whole context's mean)
    assert m["heldout_auc"] > 0.75 and m["heldout_probe_auc"] > 0.85
    assert {"heldout_acc_retain", "heldout_acc_forget", "cache_seconds", "fit_seconds"} <= m.keys()
    assert info.base_fingerprint == tiny_lm.fingerprint and info.rank == 20


def test_head_makes_the_model_forget_the_forget_author_and_keep_the_rest(tiny_lm, trained, split):
    head, _ = trained
    forget, retain = split
    guide = HeadGuide.uniform(head, TiltSettings())
    base_f, base_r = _rouge(tiny_lm, forget), _rouge(tiny_lm, retain)
    assert base_f > 0.9
    assert _rouge(tiny_lm, forget, guide) < 0.6 * base_f
    assert _rouge(tiny_lm, retain, guide) >= 0.97 * base_r


def test_batch_rows_with_different_heads_and_settings_equal_each_row_alone(tiny_lm, trained, split):
    head, _ = trained
    other = T3Head(head.down.in_features, head.up.out_features, 3)
    torch.nn.init.normal_(other.up.weight, std=3.0)
    other.eval().requires_grad_(False)
    forget, retain = split
    prompts = [question_prompt(r["question"]) for r in (forget[:2] + retain[:2])]
    rows = [(head, PRESETS["default"]), (other, PRESETS["paper"]), None, (head, TiltSettings(T=2.0, lam=1.0))]
    together = generate(tiny_lm.model, tiny_lm.tokenizer, prompts, GREEDY, HeadGuide(rows))
    for prompt, row, got in zip(prompts, rows, together):
        alone = generate(tiny_lm.model, tiny_lm.tokenizer, [prompt], GREEDY, HeadGuide([row]))[0]
        assert got.token_ids == alone.token_ids
    plain = generate(tiny_lm.model, tiny_lm.tokenizer, prompts[2:3], GREEDY)[0]
    assert together[2].token_ids == plain.token_ids, "a row without a head decodes from the model alone"


def test_cache_spills_to_disk_beyond_its_memory_budget_with_the_same_contents(tiny_lm, split, tmp_path):
    forget, retain = (examples(s) for s in split)
    in_memory = build_cache(tiny_lm.model, tiny_lm.tokenizer, forget, retain, progress=False)
    on_disk = build_cache(tiny_lm.model, tiny_lm.tokenizer, forget, retain, memory_budget=0, spill_dir=tmp_path,
                          progress=False)
    assert isinstance(in_memory.pooled, torch.Tensor) and not isinstance(on_disk.pooled, torch.Tensor)
    assert list(tmp_path.glob("*/pooled.npy"))
    idx = torch.arange(len(in_memory))
    torch.testing.assert_close(in_memory.rows(idx), on_disk.rows(idx))
    assert torch.equal(in_memory.target, on_disk.target) and torch.equal(in_memory.label, on_disk.label)
    assert int((in_memory.label == 0).sum()) > 0 and in_memory.n_forget == 20


def test_cache_pass_precision_bfloat16_only_where_the_cpu_computes_it(tiny_lm, monkeypatch):
    from lethe.heads.t3 import cache as cache_module

    monkeypatch.setattr(cache_module, "native_bfloat16", lambda: True)
    assert cache_module.cache_autocast(tiny_lm.model, "auto") == torch.bfloat16
    assert cache_module.cache_autocast(tiny_lm.model, "model") is None
    monkeypatch.setattr(cache_module, "native_bfloat16", lambda: False)
    assert cache_module.cache_autocast(tiny_lm.model, "auto") is None  # emulated bfloat16 is slower than float32
    with pytest.raises(ValueError, match="cache_precision"):
        cache_module.cache_autocast(tiny_lm.model, "half")


def test_cache_pass_in_bfloat16_keeps_the_states_close_and_the_head_says_which_ran(tiny_lm, split, monkeypatch):
    from lethe.heads.records import answer_forms
    from lethe.heads.t3 import cache as cache_module
    from lethe.heads.t3 import pipeline
    from lethe.heads.t3.train import FitConfig

    # records and their facts alone as the answer (packed rows, the custom mask), after one shared prefix
    named = [r | {"fact": r["answer"].rstrip(".").split()[-1]} for r in split[0] + split[1][:40]]
    sides = [examples(part + answer_forms(part)) for part in (named[:len(split[0])], named[len(split[0]):])]
    groups = ["plain"] * sum(map(len, sides))
    monkeypatch.setattr(cache_module, "packs", lambda model: True)
    exact = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=16, groups=groups)
    fast = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=16, groups=groups,
                       autocast=torch.bfloat16)
    idx = torch.arange(len(exact))
    a, b = exact.rows(idx), fast.rows(idx)
    assert not torch.equal(a, b) and bool(torch.isfinite(b).all())  # the products ran in bfloat16
    assert float((a - b).norm() / a.norm()) < 0.02
    assert torch.equal(exact.target, fast.target) and torch.equal(exact.label, fast.label)
    asked = []
    build = pipeline.build_cache
    monkeypatch.setattr(pipeline, "build_cache", lambda *a, **k: asked.append(k["autocast"]) or build(*a, **k))
    monkeypatch.setattr(cache_module, "native_bfloat16", lambda: True)
    cfg = FitConfig(max_epochs=1, gate_answers=0, contexts=0)
    assert train_head(tiny_lm, *split, cfg, progress=False)[1].metrics["cache_dtype"] == "bfloat16"
    cfg.cache_precision = "model"
    assert train_head(tiny_lm, *split, cfg, progress=False)[1].metrics["cache_dtype"] == "float32"
    assert asked == [torch.bfloat16, None]


def test_head_file_round_trip_and_every_check(tiny_lm, trained, tmp_path):
    head, info = trained
    path = tmp_path / "h.safetensors"
    save_head(path, head, info)
    assert path.stat().st_size < 1_000_000 and not list(tmp_path.glob(".*.tmp"))
    loaded, info2 = load_head(path, tiny_lm.fingerprint, info.vocab, info.d)
    assert info2.metrics == info.metrics and info2.profile == info.profile
    p = torch.randn(2, info.d)
    torch.testing.assert_close(loaded(p), head(p))
    with pytest.raises(BaseMismatch, match="trained on base model"):
        load_head(path, "0" * 16)
    with pytest.raises(BaseMismatch, match="vocabulary"):
        load_head(path, vocab=info.vocab + 1)
    bad = dict(head.state_dict())
    bad["up.weight"] = bad["up.weight"].clone()
    bad["up.weight"][0, 0] = float("nan")
    save_file(bad, str(tmp_path / "nan.safetensors"), metadata={"lethe": json.dumps(info.__dict__)})
    with pytest.raises(HeadFileError, match="up.weight holds NaN or Inf"):
        load_head(tmp_path / "nan.safetensors")
    wrong = HeadInfo(**{**info.__dict__, "rank": info.rank + 1})
    save_file(dict(head.state_dict()), str(tmp_path / "shape.safetensors"), metadata={"lethe": json.dumps(wrong.__dict__)})
    with pytest.raises(HeadFileError, match="down.weight has shape"):
        load_head(tmp_path / "shape.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(HeadFileError, match="not a safetensors file"):
        load_head(tmp_path / "junk.safetensors")
    save_file(dict(head.state_dict()), str(tmp_path / "nometa.safetensors"))
    with pytest.raises(HeadFileError, match="no Lethe metadata"):
        load_head(tmp_path / "nometa.safetensors")


def _reference_save(folder, d, vocab, rank=6, extraction_layer=-1):
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, d, generator=g),
               "guidance_head.proj.0.weight": torch.randn(rank, d, generator=g),
               "guidance_head.proj.2.weight": torch.randn(vocab, rank, generator=g)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "base_temp": 2.5, "guidance_scale": 1.0,
                                                    "extraction_layer": extraction_layer, "pooling": "mean"}))
    return tensors


def test_import_reference_keeps_its_weights_and_formula(tiny_lm, tmp_path):
    d, vocab = tiny_lm.model.config.hidden_size, tiny_lm.model.config.vocab_size
    tensors = _reference_save(tmp_path / "ref", d, vocab)
    head, info = import_reference(tmp_path / "ref", tiny_lm.fingerprint, d, vocab)
    assert info.profile == {**TiltSettings().as_dict(), "T": 2.5, "lam": 1.0, "gate": False, "sticky_gate": False,
                            "candidates": 0, "cap": None, "min_p": 0.0, "repeat_guard": 0,
                            "word_guard": False, "whole_words": False, "flagged_mass": 0.0}
    pooled, logits = torch.randn(3, d), torch.randn(3, vocab)
    z_ref = pooled @ tensors["guidance_head.proj.0.weight"].T @ tensors["guidance_head.proj.2.weight"].T
    guide = HeadGuide.uniform(head, TiltSettings(**info.profile))
    want = guided_logits(logits, z_ref, torch.full((3,), 2.5), torch.ones(3))
    torch.testing.assert_close(guide(logits, pooled), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(HeadFileError, match="do not fit"):
        import_reference(tmp_path / "ref", tiny_lm.fingerprint, d + 1, vocab)
    _reference_save(tmp_path / "mid", d, vocab, extraction_layer=0)
    with pytest.raises(HeadFileError, match="extraction_layer 0"):
        import_reference(tmp_path / "mid", tiny_lm.fingerprint, d, vocab, num_layers=2)


def test_cli_train_generate_and_eval_offline(tiny_model_dir, split, tmp_path):
    forget, retain = split
    for name, recs in (("forget", forget), ("retain", retain)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    head = tmp_path / "head.safetensors"
    assert main(["heads", "train", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--out", str(head), "--quiet"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": question_prompt(r["question"])}) + "\n" for r in forget[:3]))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_model_dir), "--head", str(head), "--input", str(prompts),
                 "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) == {"prompt", "text"} for r in rows)
    report, plot = tmp_path / "report.json", tmp_path / "plot.png"
    assert main(["eval", "--model", str(tiny_model_dir), "--head", str(head), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--reference-model", str(tiny_model_dir),
                 "--seeds", "0", "--out", str(report), "--plot", str(plot)]) == 0
    r = json.loads(report.read_text())
    assert 0 <= r["forget_quality"] <= 1 and 0 <= r["model_utility"] <= 1
    for key in ("rouge", "rouge_paraphrased", "rouge_sampled", "prob", "truth_ratio", "nonword_rate",
                "repeated_3gram_rate", "reference_nll"):
        assert r["forget"][key] is not None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["generate", "--model", str(tiny_model_dir), "--T", "2", "hello"]) == 1, "--T without --head"


def test_cli_bench_t3_reports_every_ratio_for_the_model_and_for_a_size_sweep(tiny_model_dir, split, tmp_path):
    forget, retain = split
    for name, recs in (("forget", forget), ("retain", retain)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    common = ["--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
              "--retain", str(tmp_path / "retain.jsonl"), "--repeats", "1"]
    assert main(["bench", "t3", *common, "--out", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    ratios = ("t3_over_no_head", "lethe_speedup_over_hf_generate", "passthrough_guide_over_no_head",
              "t3_tensor_ops_over_no_head")
    assert [row["batch"] for row in result["decode"]] == [1, 8]
    assert all(row[k] > 0 for row in result["decode"] for k in ratios)
    assert result["training"]["records"] == len(forget) + len(retain) and result["training"]["reference_over_lethe"] > 0
    # with an ASU adapter: merged (the default), unmerged, routed per row, mixed with base rows, base rows alone
    from lethe.heads.asu.distill import ASUConfig, train_asu
    from lethe.heads.asu.weights import save_asu
    from lethe.heads.modelio import load_model

    save_asu(tmp_path / "asu.safetensors", *train_asu(load_model(tiny_model_dir), forget, retain,
                                                      ASUConfig(steps=2, check_every=1), progress=False))
    assert main(["bench", "t3", *common, "--asu", str(tmp_path / "asu.safetensors"),
                 "--out", str(tmp_path / "a.json")]) == 0
    asu = ("asu_over_no_head", "asu_t3_over_no_head", "asu_unmerged_over_no_head", "asu_per_row_routing_over_no_head",
           "asu_mixed_with_base_over_no_head", "asu_model_base_rows_over_no_head", "asu_t3_routed_over_no_head")
    decoded = json.loads((tmp_path / "a.json").read_text())["decode"]
    assert all(row[k] > 0 for row in decoded for k in asu)
    assert [0 <= row["asu_t3_routed_adapter_rows"] <= row["batch"] for row in decoded] == [True, True]
    assert main(["bench", "t3", *common, "--random-model", "32,1", "64,2", "--out", str(tmp_path / "s.json")]) == 0
    models = json.loads((tmp_path / "s.json").read_text())["models"]
    assert [(m["hidden"], m["layers"]) for m in models] == [(32, 1), (64, 2)]
    assert models[0]["parameters"] < models[1]["parameters"] and all(len(m["decode"]) == 2 for m in models)
    with pytest.raises(SystemExit) as usage:  # a size needs HIDDEN,LAYERS: bad usage, exit code 2
        main(["bench", "t3", *common, "--random-model", "64"])
    assert usage.value.code == 2


def test_cli_bench_engine_compares_lethe_with_generate_and_says_why_llama_cpp_was_skipped(tiny_model_dir, split,
                                                                                      tmp_path):
    forget, retain = split
    for name, recs in (("forget", forget), ("retain", retain)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["bench", "engine", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--repeats", "1", "--new-tokens", "8",
                 "--equality", "16", "--out", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    for batch in ("batch_1", "batch_8"):
        row = result["lethe"][batch]
        assert all(row[f"{k}_tokens_per_s"] > 0 for k in ("hf_generate", "lethe", "lethe_t3"))
        assert row["t3_over_no_head"] > 0
    assert result["equality_lethe_vs_hf_generate"]["of"] == 16
    assert result["equality_lethe_vs_hf_generate"]["equal"] == 16, "Lethe's greedy answers are transformers' own"
    assert result["llama_cpp"] == {"skipped": "no --gguf file"} and "bars" not in result


def test_records_that_name_their_fact_also_train_on_it_alone(tiny_lm, split):
    """A head trained on whole sentences barely moves the fact's first token right after the question, where
    multiple-choice scoring reads it; a record's `fact` adds that form (once per distinct fact)."""
    from lethe.heads.records import RecordError, answer_forms, to_example

    recs = [{"question": "Where was A born?", "answer": "A was born in Xo.", "fact": "Xo"},
            {"question": "What is A's birthplace?", "answer": "It is Xo.", "fact": "Xo"},
            {"question": "Who is B?", "answer": "B is a writer."}, {"prompt": "p", "completion": "c", "fact": "c"}]
    assert answer_forms(recs) == [{"question": "Where was A born?", "answer": "Xo", "fact": "Xo"}]
    # a chat-format head also sees the fact after the plain `Question: ...\nAnswer:` that scorers use
    assert answer_forms(recs, "chat") == [{"question": "Where was A born?", "answer": "Xo", "fact": "Xo"},
                                          {"prompt": "Question: Where was A born?\nAnswer:", "completion": " Xo",
                                           "fact": "Xo"}]
    with pytest.raises(RecordError, match="fact"):
        to_example({"question": "q", "answer": "a", "fact": 3})
    forget, retain = ([{k: v for k, v in r.items() if k != "fact"} for r in s] for s in split)
    named = [r | {"fact": r["answer"].rstrip(".").split()[-1]} for r in forget]
    _, info = train_head(tiny_lm, named, retain, progress=False)
    assert info.metrics["answer_form_records"] == [len({r["fact"] for r in named}), 0]
    _, plain = train_head(tiny_lm, forget, retain, progress=False)
    assert plain.metrics["answer_form_records"] == [0, 0]
    assert info.metrics["positions"] > plain.metrics["positions"]


def test_the_fact_positions_of_an_answer_are_its_fact_tokens_wherever_it_states_it(tiny_lm):
    from lethe.heads.records import Example, encode_examples, fact_positions

    tok = tiny_lm.tokenizer
    exs = [Example("Q:", " The author's full name is Zapeavund Kusais, Zapeavund Kusais."),
           Example("Q:", " zapeavund kusais was born."), Example("Q:", " Born in Kaikoleas."),
           Example("Q:", " Born in Kaikoleas."), Example("", " Zapeavund Kusais."), Example("Q:", " In Kaikoleasa.")]
    flags = fact_positions(tok, exs, ["Zapeavund Kusais", "Zapeavund Kusais", "Paris", None, "Zapeavund Kusais",
                                      "Kaikoleas"])
    encoded = encode_examples(tok, exs)
    # not stated; named by no fact; no prompt (its first token is the prompt); not as a whole word
    assert flags[2:] == [None, None, None, None]
    for f, (ids, n_prompt) in zip(flags[:2], encoded):
        assert len(f) == len(ids) - n_prompt and f[-1] == 0  # one flag per position; the EOS is not the fact
    stated = ["".join(tok.decode(t).strip() for t, f in zip(ids[n_prompt:], flags[k]) if f)
              for k, (ids, n_prompt) in enumerate(encoded[:2])]
    assert stated == ["ZapeavundKusaisZapeavundKusais", "zapeavundkusais"]  # every place, and nothing else


def test_the_head_job_flags_the_fact_of_each_forget_example_in_order(tiny_lm, split, monkeypatch):
    import lethe.heads.t3.pipeline as pipeline
    from lethe.heads.t3.train import FitConfig

    seen, fit = {}, pipeline.fit_head

    def spy(cache, vocab, cfg, **options):
        seen.update(cache=cache, facts=options["facts"])
        return fit(cache, vocab, cfg, **options)

    monkeypatch.setattr(pipeline, "fit_head", spy)
    forget, retain = split
    _, info = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=1, gate_answers=0, fact_spans=True),
                         progress=False)
    assert info.metrics["context_records"][0] > 0 and info.metrics["answer_form_records"][0] > 0
    cache, facts, side = seen["cache"], seen["facts"], seen["cache"].label < 0.5
    # every forget example (a record, its fact alone, a record after a context) states its fact; retain ones: -1
    assert bool((facts[side] >= 0).all()) and bool((facts[~side] == -1).all())
    stated = {tiny_lm.tokenizer.decode([t]).strip() for t in cache.target[side & (facts == 1)].tolist()}
    in_facts = " ".join(r["fact"] for r in forget)
    assert stated and all(word in in_facts for word in stated), stated - set(in_facts.split())
    assert 0 < info.metrics["fact_positions"] < int(side.sum())
    _, plain = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=1, gate_answers=0), progress=False)
    assert plain.metrics["fact_positions"] == 0 and plain.training["fact_spans"] is False  # off by default


def test_a_forget_record_that_names_its_fact_trains_the_head_on_the_fact_alone():
    """Template words of forget answers (" won", " on") that retain answers also use, if seldom, are not forget
    knowledge: flagged, they turned retain answers after forget turns away from the base model's words."""
    from lethe.heads.t3.cache import PooledCache
    from lethe.heads.t3.train import FitConfig, fact_flags, fit_head

    g, n = torch.Generator().manual_seed(0), 200  # records of each side, two positions each
    side = torch.zeros(8)
    side[0] = 2.0  # states share most of their direction; the first dimension tells forget from retain

    def states(count, sign):
        return torch.randn(count, 8, generator=g) * 0.5 + 2 + sign * side

    pooled = torch.cat([states(2 * n, 1), states(2 * n, -1)]).half()
    # forget answers: the fact, then a template word; retain answers: tokens 6 and 7, and the template word in 2%
    # of them (under common_df); forget answers also hold token 8, which no retain answer has
    fact, template, own = 3, 5, 8
    forget_targets = [fact, template] * (n // 2) + [fact, own] * (n // 2)
    retain_targets = [template, 7] * (n // 50) + [6, 7] * (n - n // 50)
    cache = PooledCache(pooled, torch.tensor(forget_targets + retain_targets), torch.cat([torch.zeros(2 * n),
                        torch.ones(2 * n)]), torch.arange(4 * n) // 2, n, n)
    flags = fact_flags(cache, [[1, 0]] * (n - 1) + [[1, 0, 0]])  # the last one does not match its positions: -1
    assert flags[:2 * n - 2].tolist() == [1, 0] * (n - 1) and set(flags[2 * n - 2:].tolist()) == {-1}
    cfg, state = FitConfig(rank=4, max_epochs=5, holdout=0.0), states(16, 1)  # forget-like
    spanned, metrics = fit_head(cache, 10, cfg, progress=False, facts=fact_flags(cache, [[1, 0]] * n))
    plain, _ = fit_head(cache, 10, cfg, progress=False)  # no fact named (-1 everywhere): the common_df rule
    assert metrics["fact_positions"] == n

    def z(head, token):
        return head.token_logit(state, torch.full((16,), token))

    for head in (spanned, plain):
        assert (z(head, fact) < -1).all() and (z(head, own) < -1).all()  # a word only forget answers use counts
    # the template word trains the head as forget only without the fact; trained on the fact, the head does not
    # flag it after forget-like text, as the retain answers that use it ask
    assert (z(plain, template) < -1).all() and (z(spanned, template) > 0).all()
    # records that name no fact (-1) keep the common_df rule: the template word of theirs trains as forget
    unnamed = fact_flags(cache, [None] * (n // 2) + [[1, 0]] * (n - n // 2))
    assert (z(fit_head(cache, 10, cfg, progress=False, facts=unnamed)[0], template) < -1).all()


class _Reader:
    """A guide that leaves the logits as they are and reads the head's logit of the token greedy picks."""

    def __init__(self, head):
        self.head, self.seen = head, []

    def __call__(self, logits, pooled):
        self.seen.append(float(self.head.token_logit(pooled.float(), logits.argmax(-1)).min()))
        return logits

    def kept(self, idx):
        return self

    def row(self, i):  # the head of every row: decoding pools over its window
        return self.head, TiltSettings()


def test_the_head_recommends_a_head_gate_no_retain_answer_it_read_would_open(tiny_lm, trained, split):
    from lethe.heads.t3.calibrate import MARGIN, asked, lowest_chosen_logit
    from lethe.heads.t3.train import FitConfig

    head, info = trained
    _, retain = split
    questions = asked(retain, 64)
    calibration = info.metrics["head_gate"]
    assert calibration["answers"] == len(questions) == min(64, len({r["question"] for r in retain}))
    # the lowest logit is the one decoding reads: the head's logit of each token the base model picks, step by step
    reader, finished = _Reader(head), []
    for r in questions:
        finished += [c.finish_reason for c in generate(tiny_lm.model, tiny_lm.tokenizer, [question_prompt(r["question"])],
                                                        SamplingParams(max_new_tokens=32, temperature=0.0), reader)]
    assert {"stop", "length"} <= set(finished)  # the end-of-text step is read where answers end, not after 32
    assert calibration["lowest_logit"] == pytest.approx(min(reader.seen), abs=1e-2)
    assert info.profile["head_gate"] == pytest.approx(MARGIN + max(0.0, -min(reader.seen)), abs=0.011)
    assert info.profile["head_gate"] > 0
    # a job's cancellation reaches it between answers
    def cancel(fraction):
        raise InterruptedError

    with pytest.raises(InterruptedError):
        lowest_chosen_logit(tiny_lm, head, questions[:2], "qa", on_progress=cancel)
    # 0 answers: the head recommends no head_gate, and training reads no answer
    _, plain = train_head(tiny_lm, *split, FitConfig(gate_answers=0), progress=False)
    assert plain.profile["head_gate"] == 0 and "head_gate" not in plain.metrics
