"""Heads train on their records after contexts too (`heads.t3.contexts`), and records that begin alike run their
shared first tokens once in the cache pass (`heads.t3.cache.batches`), records with the same prompt in one row."""

import copy

import pytest
import torch

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import Context, answer_forms, ask, encode_example, encode_examples, examples, qa_example
from lethe.heads.t3 import cache as cache_module
from lethe.heads.t3.cache import build_cache, context_shifts
from lethe.heads.t3.pooling import pooled_positions
from lethe.heads.t3.contexts import RETAIN_PER_FORGET, SMALL_TALK, context_counts, context_examples, draw_contexts
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.train import FitConfig, shifted

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
    f, f_which, f_sources = context_examples(forget, contexts, len(forget), seed=0)
    r, r_which, _ = context_examples(retain, contexts, 10, seed=1)
    assert len(f) == len(forget) and len(r) == len(r_which) == 10
    assert all(0 <= j < 8 for j in f_which + r_which)
    assert sorted(e.completion for e in f) == sorted(" " + q["answer"] for q in forget)  # each forget record once
    assert context_examples(forget, contexts, 0) == ([], [], [])
    # per forget record, and RETAIN_PER_FORGET times as many retain records: the retain set is often larger
    assert context_counts(forget, 1.0) == (len(forget), RETAIN_PER_FORGET * len(forget))
    assert context_counts(forget, 0.5)[0] == round(len(forget) / 2) and context_counts(forget, 0) == (0, 0)
    twice, _, _ = context_examples(forget, contexts, 2 * len(forget), seed=0)  # each forget record after two contexts
    assert sorted(e.completion for e in twice) == sorted(2 * [" " + q["answer"] for q in forget])


def test_earlier_turns_come_from_the_tenants_records_and_from_small_talk(split):
    forget, retain = split
    own = {(r["question"], r["answer"]) for r in forget + retain}
    turns = [t for c in draw_contexts(forget + retain) for t in c.turns]
    assert set(turns) <= own | set(SMALL_TALK)
    assert any(t in own for t in turns) and any(t in SMALL_TALK for t in turns)  # both kinds of conversation


def forwards(plan) -> int:
    """The forward passes a cache pass's plan makes: one for each chunk's prefixes, one a batch."""
    return sum(bool(chunk.prefixes) + len(chunk.batches) for chunk in plan)


@pytest.mark.parametrize("mix", [True, False])
def test_records_that_begin_alike_run_their_shared_tokens_once_with_the_same_states(tiny_lm, split, monkeypatch, mix):
    """Each context runs once; with `mix` (a decoder that reads the positions given) the contexts' prefixes, of
    several lengths, run together in one forward and their rows share batches, each row seeing its own prefix only."""
    forget, retain = split
    contexts = draw_contexts(forget + retain, n=4)
    sides, groups = [], []
    for i, records in enumerate((forget, retain[:40])):
        after, which, _ = context_examples(records, contexts, len(records), seed=i)
        # the fact alone as a second answer: rows of two examples (a mask of their own) beside rows of one
        named = [r | {"fact": r["answer"].rstrip(".").split()[-1]} for r in records]
        plain = examples(named + answer_forms(named))
        sides.append(plain + after)
        groups += ["plain"] * len(plain) + which
    if mix:  # the plan mixes: a batch holds rows after prefixes of different lengths, and rows of two examples
        encoded = encode_examples(tiny_lm.tokenizer, sides[0] + sides[1])
        plans = {m: cache_module.batches(encoded, groups, 32, True, m) for m in (True, False)}
        mixed = [batch for chunk in plans[True] for batch in chunk.batches
                 if len({len(chunk.prefixes[p]) for _, p in batch}) > 1]
        assert any(len(unit) > 1 for batch in mixed for unit, _ in batch)
        assert forwards(plans[True]) < forwards(plans[False])  # several groups' prefixes in one forward
    tokens = []
    forward = cache_module.forward_last_hidden
    monkeypatch.setattr(cache_module, "forward_last_hidden",
                        lambda model, ids, *a: tokens.append(ids.numel()) or forward(model, ids, *a))
    monkeypatch.setattr(cache_module, "packs", lambda model: mix)
    for window in (0, 4):
        tokens.clear()
        alone = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window)
        alone_tokens = sum(tokens)
        tokens.clear()
        shared = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window, groups=groups)
        assert sum(tokens) < 0.8 * alone_tokens  # the contexts ran once each
        if mix:
            assert len(tokens) == forwards(plans[True])  # the pass ran as planned
        torch.testing.assert_close(shared.pooled.float(), alone.pooled.float(), atol=2e-3, rtol=0)
        assert torch.equal(shared.target, alone.target) and torch.equal(shared.record, alone.record)
        assert torch.equal(shared.label, alone.label)


def test_records_with_the_same_prompt_run_it_once_in_one_row_with_the_same_states(tiny_lm, split, monkeypatch):
    """A record and its fact alone as the answer ask the same question: one row holds the prompt once and both
    answers, each answer seeing the prompt and itself only, and each gets the states it gets alone."""
    forget, retain = split
    named = [r | {"fact": r["answer"].rstrip(".").split()[-1]} for r in forget + retain[:40]]
    sides = [examples(part + answer_forms(part)) for part in (named[:len(forget)], named[len(forget):])]
    tokens = []
    forward = cache_module.forward_last_hidden
    monkeypatch.setattr(cache_module, "forward_last_hidden",
                        lambda model, ids, *a: tokens.append(ids.numel()) or forward(model, ids, *a))
    for window, groups in ((0, None), (4, None), (16, ["plain"] * sum(map(len, sides)))):
        tokens.clear()
        with monkeypatch.context() as m:  # packed whatever attention an earlier test registered on the shared model
            m.setattr(cache_module, "packs", lambda model: True)
            packed = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window,
                                 groups=groups)
        packed_tokens = sum(tokens)
        tokens.clear()
        with monkeypatch.context() as m:
            m.setattr(cache_module, "packs", lambda model: False)
            alone = build_cache(tiny_lm.model, tiny_lm.tokenizer, *sides, progress=False, window=window, groups=groups)
        assert packed_tokens < 0.85 * sum(tokens)  # each form's question ran once, with its record's
        torch.testing.assert_close(packed.pooled.float(), alone.pooled.float(), atol=2e-3, rtol=0)
        assert torch.equal(packed.target, alone.target) and torch.equal(packed.record, alone.record)
        assert torch.equal(packed.label, alone.label)
        # and both are what the model gives each example run on its own, with no mask of ours
        for i in (0, len(forget), len(sides[0]) + 1):
            seq, n_prompt = encode_example(tiny_lm.tokenizer, (sides[0] + sides[1])[i])
            ids = torch.tensor([seq])
            hidden = forward(tiny_lm.model, ids, torch.ones_like(ids), torch.arange(len(seq))[None], None)
            own = pooled_positions(hidden.float(), window)[0, n_prompt - 1:len(seq) - 1]
            torch.testing.assert_close(packed.pooled[packed.record == i].float(), own, atol=2e-3, rtol=0)


def test_only_decoders_that_read_the_positions_given_on_full_attention_pack_a_row():
    from types import SimpleNamespace

    def model(**config):
        base = {"model_type": "llama", "sliding_window": None, "layer_types": None, "_attn_implementation": "sdpa"}
        return SimpleNamespace(config=SimpleNamespace(**(base | config)))

    assert cache_module.packs(model()) and cache_module.packs(model(_attn_implementation="eager"))
    assert cache_module.packs(model(layer_types=["full_attention"] * 4))
    assert not cache_module.packs(model(sliding_window=4096))  # a custom mask would lose the window
    assert not cache_module.packs(model(layer_types=["sliding_attention", "full_attention"]))
    assert not cache_module.packs(model(model_type="bloom"))  # ALiBi: no position ids
    assert not cache_module.packs(model(_attn_implementation="flash_attention_2"))


def test_a_context_shift_is_what_a_context_did_to_the_same_answers_pooled_states(tiny_lm, split):
    forget, retain = split
    contexts = draw_contexts(forget + retain, n=4, seed=1)
    after, _, sources = context_examples(forget, contexts, len(forget), seed=0)
    assert [e.completion for e in after] == [" " + forget[i]["answer"] for i in sources]  # each asks its source
    plain = examples(forget)
    cache = build_cache(tiny_lm.model, tiny_lm.tokenizer, plain + after, examples(retain[:4]), progress=False,
                        window=16)
    pairs = [(len(plain) + k, i) for k, i in enumerate(sources)]
    made = context_shifts(cache, pairs)
    shifts = made.shifts
    first = cache.pooled[cache.record == len(plain)].float() - cache.pooled[cache.record == sources[0]].float()
    torch.testing.assert_close(shifts[:len(first)].float(), first, atol=2e-3, rtol=0)
    assert len(shifts) == sum(int((cache.record == a).sum()) for a, _ in pairs)
    assert float(shifts.float().norm(dim=1).mean()) > 0.05 * float(cache.pooled.float().norm(dim=1).mean())
    # they may go to the rows of the examples they were measured on, not to the retain examples outside `pairs`
    assert torch.equal(made.rows, cache.record < len(plain) + len(after))
    other = next(j for j, e in enumerate(plain) if len(e.completion) != len(after[0].completion))
    lengths = [int((cache.record == i).sum()) for i in (len(plain), other)]
    if lengths[0] != lengths[1]:  # answers of other lengths face no position of each other: left out
        assert len(context_shifts(cache, [(len(plain), other)]).shifts) == 0


def test_shifted_adds_one_drawn_shift_to_about_its_share_of_the_rows():
    pooled, shifts = torch.zeros(2000, 4), torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4]).half()
    out = shifted(pooled, shifts, 0.5, torch.Generator().manual_seed(0))
    moved = out.abs().sum(1) > 0
    assert 0.45 < float(moved.float().mean()) < 0.55
    assert set(out[moved].unique().tolist()) == {1.0, 2.0, 3.0} and bool((out[moved].std(1) == 0).all())
    assert torch.equal(shifted(pooled, shifts, 0.0, torch.Generator()), pooled)
    eligible = torch.arange(2000) < 1000
    out = shifted(pooled, shifts, 0.5, torch.Generator().manual_seed(0), eligible)
    assert bool((out[1000:] == 0).all()) and 0.4 < float((out[:1000].abs().sum(1) > 0).float().mean()) < 0.6


def test_the_head_job_reports_its_context_records_and_can_turn_them_off(tiny_lm, split):
    forget, retain = split
    _, on = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2), progress=False)
    _, off = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2, contexts=0), progress=False)
    assert on.metrics["context_records"] == list(context_counts(forget, 1.0))
    assert off.metrics["context_records"] == [0, 0] and on.metrics["positions"] > off.metrics["positions"]
    assert on.training["contexts"] == 1.0 and on.training["context_shift"] == 0.0
    shifted_head, info = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2, context_shift=0.5), progress=False)
    assert info.training["context_shift"] == 0.5 and info.metrics["positions"] == on.metrics["positions"]
    plain_head, _ = train_head(tiny_lm, forget, retain, FitConfig(max_epochs=2), progress=False)
    assert not torch.equal(shifted_head.up.weight, plain_head.up.weight)  # the same records, other rows trained


def test_a_head_job_asking_for_contexts_or_a_context_shift_out_of_range_is_refused_naming_the_field():
    from pydantic import ValidationError

    from lethe.server.protocol import HeadJobRequest

    assert HeadJobRequest(forget="ds_a", retain="ds_b").contexts == 1.0
    assert HeadJobRequest(forget="ds_a", retain="ds_b", contexts=2).contexts == 2
    for bad in (-0.1, 4.5, float("nan")):
        with pytest.raises(ValidationError, match="contexts"):
            HeadJobRequest(forget="ds_a", retain="ds_b", contexts=bad)
    assert HeadJobRequest(forget="ds_a", retain="ds_b").context_shift == FitConfig().context_shift
    for bad in (-0.1, 1.5, float("inf")):
        with pytest.raises(ValidationError, match="context_shift"):
            HeadJobRequest(forget="ds_a", retain="ds_b", context_shift=bad)
