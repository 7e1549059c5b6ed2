"""Heads train on their records after contexts too (`heads.t3.contexts`), and records that begin alike run their
shared first tokens once in the cache pass (`heads.t3.cache.batches`)."""

import copy

import pytest
import torch

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import Context, ask, examples, qa_example
from lethe.heads.t3 import cache as cache_module
from lethe.heads.t3.cache import build_cache
from lethe.heads.t3.contexts import RETAIN_PER_FORGET, context_counts, context_examples, draw_contexts
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig

@pytest.fixture(scope="module")
def split(tiny_records):
    return split_by_author(tiny_records, 1)


CTX = Context(system="Be brief.", turns=(("Who is B?", "B is a poet."),), before="A quiz.", after="One word.")


def test_a_context_comes_before_the_question_in_the_plain_and_the_chat_format(tiny_lm):
    assert ask("Where was A born?", "qa", ctx=CTX) == ("Be brief.\nQuestion: Who is B?\nAnswer: B is a poet.\nA quiz.\n"
                                                       "Question: Where was A born? One word.\nAnswer:")
    assert ask("Where was A born?", "qa") == "Question: Where was A born?\nAnswer:"
    tok = copy.deepcopy(tiny_lm.tokenizer)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ex = qa_example("Where was A born?", "In Xo.", "chat", tok, CTX)
    assert ex.prompt == ("<system>Be brief.</s><user>Who is B?</s><assistant>B is a poet.</s>"
                         "<user>A quiz.\n\nWhere was A born? One word.</s><assistant>")
    assert ex.completion == "In Xo.</s>"


def test_forget_and_retain_records_train_after_the_same_contexts(split):
    forget, retain = split
    contexts = draw_contexts(forget + retain, n=8, seed=3)
    assert contexts == draw_contexts(forget + retain, n=8, seed=3) and len(set(contexts)) == 8
    assert any(c.turns for c in contexts) and any(c.before for c in contexts)
    f, f_which = context_examples(forget, contexts, len(forget), seed=0)
    r, r_which = context_examples(retain, contexts, 10, seed=1)
    assert len(f) == len(forget) and len(r) == len(r_which) == 10
    assert all(0 <= j < 8 for j in f_which + r_which)
    assert sorted(e.completion for e in f) == sorted(" " + q["answer"] for q in forget)  # each forget record once
    assert context_examples(forget, contexts, 0) == ([], [])
    # per forget record, and RETAIN_PER_FORGET times as many retain records: the retain set is often larger
    assert context_counts(forget, 1.0) == (len(forget), RETAIN_PER_FORGET * len(forget))
    assert context_counts(forget, 0.5)[0] == round(len(forget) / 2) and context_counts(forget, 0) == (0, 0)
    twice, _ = context_examples(forget, contexts, 2 * len(forget), seed=0)  # each forget record after two contexts
    assert sorted(e.completion for e in twice) == sorted(2 * [" " + q["answer"] for q in forget])


def test_records_that_begin_alike_run_their_shared_tokens_once_with_the_same_states(tiny_lm, split, monkeypatch):
    forget, retain = split
    contexts = draw_contexts(forget + retain, n=4)
    sides, groups = [], []
    for i, records in enumerate((forget, retain[:40])):
        after, which = context_examples(records, contexts, len(records), seed=i)
        sides.append(examples(records) + after)
        groups += ["plain"] * len(records) + which
    tokens = []
    forward = cache_module.forward_last_hidden
    monkeypatch.setattr(cache_module, "forward_last_hidden",
                        lambda model, ids, *a: tokens.append(int(a[0][:, -ids.size(1):].sum())) or forward(model, ids, *a))
    for window in (0, 4):
        tokens.clear()
        alone = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window)
        alone_tokens = sum(tokens)
        tokens.clear()
        shared = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window, groups=groups)
        assert sum(tokens) < 0.8 * alone_tokens  # the contexts ran once each
        torch.testing.assert_close(shared.pooled.float(), alone.pooled.float(), atol=2e-3, rtol=0)
        assert torch.equal(shared.target, alone.target) and torch.equal(shared.record, alone.record)
        assert torch.equal(shared.label, alone.label)


def test_the_head_job_reports_its_context_records_and_can_turn_them_off(tiny_lm, split):
    forget, retain = split
    _, on = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2), progress=False)
    _, off = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2, contexts=0), progress=False)
    assert on.metrics["context_records"] == list(context_counts(forget, 1.0))
    assert off.metrics["context_records"] == [0, 0] and on.metrics["positions"] > off.metrics["positions"]
    assert on.training["contexts"] == 1.0


def test_a_head_job_asking_for_contexts_outside_0_to_4_is_refused_naming_the_field():
    from pydantic import ValidationError

    from lethe.server.protocol import HeadJobRequest

    assert HeadJobRequest(forget="ds_a", retain="ds_b").contexts == 1.0
    assert HeadJobRequest(forget="ds_a", retain="ds_b", contexts=2).contexts == 2
    for bad in (-0.1, 4.5, float("nan")):
        with pytest.raises(ValidationError, match="contexts"):
            HeadJobRequest(forget="ds_a", retain="ds_b", contexts=bad)
