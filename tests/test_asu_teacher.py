"""ASU's teacher diagnostic (`heads/asu/teacher.py`, `lethe asu teacher`) and the KL retain loss."""

import json

import pytest

from lethe.clients.cli import main
from lethe.heads.asu.distill import ASUConfig, train_asu
from lethe.heads.asu.teacher import Setting, diagnose, pick, token_roles
from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import Example, qa_example


def test_a_records_fact_is_its_content_and_the_end_of_turn_is_left_out(tiny_lm):
    tok = tiny_lm.tokenizer
    ex = qa_example("Where was Ada born?", "Ada was born in Paris.", "qa", tok)
    ids = tok(ex.completion, add_special_tokens=False)["input_ids"]
    roles = token_roles(tok, ex, "Ada was born in Paris.", "Paris")
    assert len(roles) == len(ids) and None not in roles
    content = tok.decode([i for i, r in zip(ids, roles) if r == "content"]).strip()
    assert content == "Paris"
    assert "born" in tok.decode([i for i, r in zip(ids, roles) if r == "other"])
    # without a fact: the words outside the function words
    words = token_roles(tok, ex, "Ada was born in Paris.", None)
    pieces = [tok.decode([i]).strip() for i, r in zip(ids, words) if r == "content"]
    assert "".join(pieces) == "AdabornParis" and "was" not in pieces and "in" not in pieces
    # text after the answer (a template's end of turn) has no role
    tail = Example(ex.prompt, ex.completion + " <end>")
    assert token_roles(tok, tail, "Ada was born in Paris.", "Paris")[-1] is None


def test_tau_one_changes_nothing_and_a_hot_teacher_lowers_the_answer(tiny_lm, tiny_records):
    forget, _ = split_by_author(tiny_records, 1)
    settings = diagnose(tiny_lm, forget, taus=(1.0, 16.0), groups=["all", "0-0"], limit=8)
    assert [(s.tau, s.layers) for s in settings] == [(1.0, "all"), (16.0, "all"), (1.0, "0-0"), (16.0, "0-0")]
    identity = [s for s in settings if s.tau == 1.0]
    assert all(abs(s.content_drop) < 1e-3 and abs(s.other_drop) < 1e-3 for s in identity)
    assert all(s.fact_flips == 0 and s.other_flips == 0 for s in identity)  # the same top token everywhere
    hot = next(s for s in settings if s.tau == 16.0 and s.layers == "all")
    assert hot.content_drop > 0.1 and 0 < hot.records <= 8, hot
    assert 0 < hot.fact_flips <= 1 and 0 <= hot.other_flips <= 1, hot  # a hot teacher changes greedy choices
    # only facts the model knows are measured: none is certain, so none is left
    with pytest.raises(ValueError, match="none of these facts"):
        diagnose(tiny_lm, forget, taus=(2.0,), groups=["all"], limit=8, known_logprob=0.0)


def test_the_pick_flips_facts_most_beyond_the_other_tokens():
    # SmolLM2's own numbers (docs/asu-teacher-real.json): the most selective in nats flips facts no more than
    # other tokens; the pick flips 84% of the facts and 57% of the rest
    settings = [Setting(2.0, "0-9", 1.861, 0.603, 3.09, 25, 0.32, 0.318),
                Setting(8.0, "20-29", 4.636, 1.87, 2.48, 25, 0.84, 0.572),
                Setting(4.0, "all", 9.483, 5.099, 1.86, 25, 1.0, 0.874),
                Setting(1.5, "0-9", 0.782, 0.141, 5.55, 25, 0.24, 0.148)]
    assert (pick(settings).tau, pick(settings).layers) == (8.0, "20-29")
    assert (pick(settings, min_flips=0.9).tau, pick(settings, min_flips=0.9).layers) == (4.0, "all")
    assert pick(settings, min_drop=10.0) is None and pick(settings, min_flips=1.01) is None


def test_cli_asu_teacher_prints_each_setting_and_the_pick(tiny_model_dir, sets, tmp_path, capsys):
    out = tmp_path / "teacher.json"
    assert main(["asu", "teacher", "--model", str(tiny_model_dir), "--forget", str(sets[0] / "forget.jsonl"), "--taus", "2", "16",
                 "--layers", "all", "--limit", "6", "--min-drop", "0", "--min-flips", "0", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["tau"], d["layers"]) for d in lines[:-1]] == [(2.0, "all"), (16.0, "all")]
    assert lines[-1]["pick"] is not None and json.loads(out.read_text())["pick"] == lines[-1]["pick"]


def test_the_forget_kl_is_measured_where_training_ended(tiny_lm, tiny_records):
    """A run whose last steps come after its last check still reports the KL after them (a 20-step job reported
    its start as its end, as if nothing had moved)."""
    forget, retain = split_by_author(tiny_records, 1)
    _, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=16.0, steps=5, check_every=25), progress=False)
    history = info.metrics["forget_kl_history"]
    assert [s for s, _ in history] == [0, 5] and info.metrics["forget_kl_end"] == round(history[-1][1], 4)
    assert info.metrics["forget_kl_end"] < info.metrics["forget_kl_start"]


def test_kl_retain_loss_trains(tiny_lm, tiny_records):
    """The KL retain loss (to the original model) runs: it used to fail on its first step."""
    forget, retain = split_by_author(tiny_records, 1)
    tensors, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=4, check_every=2,
                                                                  retain_loss="kl"), progress=False)
    assert tensors and info.training["retain_loss"] == "kl" and info.steps >= 2


def test_asu_can_distil_along_the_models_own_answers(tiny_lm, tiny_records):
    """With own_answers, records naming their fact are distilled along the model's own greedy answer where it
    states the fact, and left out where it does not; a forget set whose facts the model never states is refused."""
    from lethe.heads.asu.teacher import own_answers

    forget, retain = split_by_author(tiny_records, 1)
    assert all("fact" in r for r in forget)
    kept = own_answers(tiny_lm, forget, "qa")
    assert kept and all(r["fact"].lower() in r["answer"].lower() for r in kept)
    tensors, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=2, check_every=1, own_answers=True),
                              progress=False)
    assert tensors and info.training["own_answers"] is True
    unknown = [r | {"fact": "Zzyzxquorble"} for r in forget]
    with pytest.raises(ValueError, match="none of the forget set's facts"):
        train_asu(tiny_lm, unknown, retain, ASUConfig(tau=4.0, steps=2, own_answers=True), progress=False)
    # own answers by a preset's default, not asked for: the set's own answers instead, and the metrics say so
    _, fell_back = train_asu(tiny_lm, unknown, retain, ASUConfig(tau=4.0, steps=2, check_every=1, own_answers=True,
                                                                 own_answers_fallback=True), progress=False)
    assert "state none of the facts" in fell_back.metrics["own_answers"]
    assert fell_back.metrics["examples"]["forget"] == len(unknown)
    # a record naming a fact but asking no question is kept as it is (there is nothing to ask the model)
    assert own_answers(tiny_lm, [{"text": "Ada was born in Paris.", "fact": "Paris"}], "qa") == \
        [{"text": "Ada was born in Paris.", "fact": "Paris"}]


def test_the_kl_retain_loss_can_follow_the_models_own_retain_answers(tiny_lm, tiny_records, monkeypatch):
    """With retain_own_answers the student is held to the original along the model's own greedy answers to the
    retain questions (where its generations go), not the retain set's sentences; with the gd loss it is refused."""
    import lethe.heads.asu.distill as distill
    from lethe.heads.asu.teacher import greedy_answers

    forget, retain = split_by_author(tiny_records, 1)
    qa = [r | {"answer": "Nobody knows that."} for r in retain[:6]]  # not what the model says
    retain = qa + [{"text": "A retain text without a question."}]
    seen = []
    real = distill.examples
    monkeypatch.setattr(distill, "examples", lambda recs, fmt, tok: seen.append([r.get("answer", r.get("text"))
                                                                                 for r in recs]) or real(recs, fmt, tok))
    own = [a or "Nobody knows that." for a in greedy_answers(tiny_lm, qa, "qa")]
    assert "Nobody knows that." not in own
    tensors, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=2, check_every=1, retain_loss="kl",
                                                                  retain_own_answers=True, format="qa"),
                              progress=False)
    assert tensors and info.training["retain_own_answers"] is True
    # the retain side: the model's own answers, and a record without a question kept as it is
    assert seen[1] == own + ["A retain text without a question."]
    with pytest.raises(ValueError, match="retain_own_answers"):
        train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=2, retain_own_answers=True), progress=False)


def test_a_gated_run_decodes_each_greedy_answer_once(tiny_lm, tiny_records, monkeypatch):
    """Own answers, the model's own retain answers and the gate's training all want the base model's greedy answer
    to the same questions: a run decodes each once (the gate's sampled answers are its own)."""
    import lethe.heads.asu.teacher as teacher

    forget, retain = split_by_author(tiny_records, 1)
    forget, retain = forget[:4], retain[:6]
    greedy = []
    real = teacher._answers
    monkeypatch.setattr(teacher, "_answers", lambda lm, recs, fmt, **kw: (
        greedy.extend(r["question"] for r in recs) if kw["temperature"] == 0 else None) or real(lm, recs, fmt, **kw))
    _, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=1, check_every=1, own_answers=True,
                                                            retain_loss="kl", retain_own_answers=True,
                                                            lora_layers="1", gate=True, gate_samples=1, format="qa"),
                        progress=False)
    assert info.gate and info.metrics["gate"]["positions"]["retain"] > 0
    asked = [r["question"] for r in forget + retain]
    assert sorted(greedy) == sorted(set(asked)), "each question decoded greedily once"
    memo = {}
    first = teacher.greedy_answers(tiny_lm, retain, "qa", memo=memo)
    assert teacher.greedy_answers(tiny_lm, retain[::-1], "qa", memo=memo) == first[::-1]
    assert teacher.greedy_answers(tiny_lm, retain, "qa") == first  # as decoded without a memo
    # a job's teacher diagnostic decodes the same forget questions first: training reuses its answers
    from lethe.heads.asu.presets import configure

    greedy.clear()
    said = {}
    cfg, report = configure(tiny_lm, forget, {"steps": 1, "own_answers": True, "format": "qa"}, memo=said)
    assert report is not None and sorted(greedy) == sorted({r["question"] for r in forget})
    train_asu(tiny_lm, forget, retain, cfg, progress=False, memo=said)
    assert sorted(greedy) == sorted({r["question"] for r in forget}), "training decoded none of them again"


def test_asu_can_also_distil_and_hold_records_asked_after_a_context(tiny_lm, tiny_records, monkeypatch):
    """contexts=1: each forget question/answer record is distilled a second time after a context (its fact kept
    for distil="fact"), and twice as many retain records are held after one; the teacher reads the same context."""
    import lethe.heads.asu.distill as distill

    forget, retain = split_by_author(tiny_records, 1)
    forget, retain = forget[:4], retain[:10]
    taught = []
    real = distill.forget_targets
    monkeypatch.setattr(distill, "forget_targets", lambda model, tok, exs, recs, *a: taught.append((exs, recs))
                        or real(model, tok, exs, recs, *a))
    _, info = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=2, check_every=1, contexts=1, format="qa",
                                                           distil="fact"), progress=False)
    assert info.training["contexts"] == 1
    assert info.metrics["examples"] == {"forget": 8, "retain": 18}
    exs, recs = taught[0]
    assert len(exs) == len(recs) == 8
    for ex, r in zip(exs[4:], recs[4:]):  # after a context: longer prompt, same question and answer
        assert ex.prompt != f"Question: {r['question']}\nAnswer:" and r["question"] in ex.prompt
        assert ex.completion.strip() == r["answer"].strip()
    _, plain = train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=1, format="qa"), progress=False)
    assert plain.metrics["examples"] == {"forget": 4, "retain": 10}
    with pytest.raises(ValueError, match="contexts"):
        train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=1, contexts=-1), progress=False)


def test_asu_distils_along_the_students_own_answers_that_still_state_the_fact(tiny_lm, tiny_records, monkeypatch):
    """student_answers=1: halfway, the student answers the forget questions; the answers that still state the fact
    join the distillation (with the teacher read along them, on the base weights), the others do not."""
    import lethe.heads.asu.distill as distill
    import lethe.heads.asu.teacher as teacher

    forget, retain = split_by_author(tiny_records, 1)
    forget = [r | {"fact": r["answer"].split()[-1].strip(".")} for r in forget[:4]]
    calls = []

    def student_says(lm, records, fmt, max_new_tokens=48):
        calls.append(any("lora_" in n for n, _ in lm.model.named_parameters()))  # the student answers
        return [f"I think {r['fact']}." if i % 2 == 0 else "I do not know." for i, r in enumerate(records)]

    monkeypatch.setattr(teacher, "greedy_answers", student_says)
    taught = []
    real = distill.forget_targets
    monkeypatch.setattr(distill, "forget_targets", lambda model, tok, exs, recs, *a: taught.append(
        (list(exs), any(getattr(m, "disable_adapters", False) for m in model.modules()))) or real(model, tok, exs,
                                                                                                    recs, *a))
    _, info = train_asu(tiny_lm, forget, retain[:8], ASUConfig(tau=4.0, steps=4, check_every=1, student_answers=1,
                                                               format="qa", distil="fact"), progress=False)
    assert calls == [True]
    assert info.metrics["student_answers_stating_fact"] == {"questions": 4, "rounds": [[2, 2]]}
    assert info.metrics["examples"]["forget"] == 6
    added, adapter_off = taught[-1]
    assert [e.completion.strip() for e in added] == [f"I think {forget[0]['fact']}.", f"I think {forget[2]['fact']}."]
    assert adapter_off  # the teacher is the base model tempered, not the student
    with pytest.raises(ValueError, match="student_answers"):
        train_asu(tiny_lm, forget, retain, ASUConfig(tau=4.0, steps=1, student_answers=-1), progress=False)
    with pytest.raises(ValueError, match="names its `fact`"):  # nothing to look for in the student's answers
        train_asu(tiny_lm, [{k: v for k, v in r.items() if k != "fact"} for r in forget], retain,
                  ASUConfig(tau=4.0, steps=1, student_answers=1), progress=False)


def test_distilling_the_fact_only_learns_the_teacher_at_the_facts_tokens_and_the_original_elsewhere(tiny_lm):
    """distil="fact": the target is the tempered teacher where the answer's fact is predicted and the original
    model everywhere else in the answer (its end of turn included); a bare text record follows the teacher."""
    import torch

    from lethe.heads.asu.distill import fact_masks, forget_targets

    tok = tiny_lm.tokenizer
    records = [{"question": "Where was Ada born?", "answer": "Ada was born in Paris.", "fact": "Paris"},
               {"text": "Ada was born in Paris."}]
    exs = [qa_example(records[0]["question"], records[0]["answer"], "qa", tok), Example("", records[1]["text"])]
    layers = list(range(tiny_lm.model.config.num_hidden_layers))
    answer = forget_targets(tiny_lm.model, tok, exs, records, ASUConfig(tau=16.0), layers, tiny_lm.device)
    ids = tok(exs[0].completion, add_special_tokens=False)["input_ids"]
    assert len(answer[0]) == len(ids) + 1  # a target per answer token and the end of text
    masks = fact_masks(tok, exs, records, [len(t) for t in answer])
    assert tok.decode([i for i, m in zip(ids, masks[0]) if m]).strip() == "Paris" and not masks[0][-1]
    assert bool(masks[1].all())
    fact = forget_targets(tiny_lm.model, tok, exs, records, ASUConfig(tau=16.0, distil="fact"), layers, tiny_lm.device)
    original = forget_targets(tiny_lm.model, tok, exs, records, ASUConfig(tau=1.0), layers, tiny_lm.device)
    m = masks[0]
    assert torch.equal(fact[0][m], answer[0][m])
    assert torch.allclose(fact[0][~m].float(), original[0][~m].float(), atol=1e-3)
    assert not torch.allclose(answer[0][~m].float(), original[0][~m].float(), atol=1e-2)  # the teacher differs there
    assert torch.equal(fact[1], answer[1])
    # fact-out: at the other positions the original without the fact's token, renormalised
    out = forget_targets(tiny_lm.model, tok, exs, records, ASUConfig(tau=16.0, distil="fact-out"), layers,
                         tiny_lm.device)
    paris = [i for i, k in zip(ids, m) if k]
    assert torch.equal(out[0][m], answer[0][m])
    kept = original[0][~m].float()
    kept[:, paris] = float("-inf")
    assert torch.allclose(out[0][~m].float().exp(), torch.softmax(kept, -1), atol=2e-3)
    assert float(out[0][~m][:, paris].float().exp().max()) < 1e-6 < float(original[0][~m][:, paris].float().exp().max())
    with pytest.raises(ValueError, match="distil"):
        train_asu(tiny_lm, records[:1], records[:1], ASUConfig(distil="tokens"), progress=False)


def test_without_a_tau_the_teacher_is_the_diagnostics_pick_or_the_fallback_with_its_reason(tiny_lm, tiny_records):
    """What an ASU job (and `lethe asu train`) distils from when no tau is asked: the pick among candidates (on the
    layers asked for), or tau 16 where the forget set gives the diagnostic nothing to measure."""
    from lethe.heads.asu.teacher import choose_teacher

    forget, _ = split_by_author(tiny_records, 1)
    tau, layers, report = choose_teacher(tiny_lm, forget, "1", "qa")
    settings = report.get("settings", [])
    assert report["chosen"] == {"tau": tau, "layers": layers or "all"} and report["reason"]
    assert all(s["layers"] == "1" for s in settings)  # only the layers asked for were measured
    if report["pick"] is not None:
        assert (report["pick"]["tau"], report["pick"]["layers"]) == (tau, layers)
        assert report["pick"]["fact_flips"] >= 0.5
    else:
        assert tau == 16.0 and layers == "1"
    tau, layers, report = choose_teacher(tiny_lm, [{"text": r["answer"]} for r in forget], None, "qa")
    assert (tau, layers) == (16.0, None) and "question/answer" in report["reason"]
