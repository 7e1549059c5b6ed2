import pytest
import torch

from lethe.heads.decoding.decode import generate
from lethe.heads.records import question_prompt
from lethe.heads.decoding.sampling import SamplingParams, logits_to_probs

GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


def _prompts(records, n=6):
    return [question_prompt(r["question"]) for r in records[:: max(1, len(records) // n)][:n]]


def test_batched_greedy_equals_each_row_alone_and_transformers_generate(tiny_lm, tiny_records):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    prompts = _prompts(tiny_records) + ["Question: Who?\nAnswer:"]  # lengths differ: left padding
    batch = generate(model, tok, prompts, GREEDY)
    for prompt, got in zip(prompts, batch):
        alone = generate(model, tok, [prompt], GREEDY)[0]
        assert got.token_ids == alone.token_ids
        enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
        ref = model.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        ref_ids = [t for t in ref[0, enc.input_ids.shape[1]:].tolist() if t != tok.eos_token_id]
        assert got.token_ids == ref_ids


def test_memorised_answer_ends_at_eos_with_stop_reason(tiny_lm, tiny_records):
    r = tiny_records[1]
    out = generate(tiny_lm.model, tiny_lm.tokenizer, [question_prompt(r["question"])], GREEDY)[0]
    assert out.text.strip() == r["answer"] and out.finish_reason == "stop"
    assert out.prompt_tokens == len(tiny_lm.tokenizer(question_prompt(r["question"]))["input_ids"])


def test_max_new_tokens_and_stop_strings(tiny_lm, tiny_records):
    r = tiny_records[1]  # "<name> was born in <city>."
    prompt = question_prompt(r["question"])
    short = generate(tiny_lm.model, tiny_lm.tokenizer, [prompt], SamplingParams(max_new_tokens=2, temperature=0))[0]
    assert short.finish_reason == "length" and short.completion_tokens == 2
    stopped = generate(tiny_lm.model, tiny_lm.tokenizer, [prompt],
                       SamplingParams(max_new_tokens=40, temperature=0, stop=[" born"]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == " " + r["answer"].split(" born")[0]


def test_seeded_sampling_is_reproducible_per_row_whatever_the_batch(tiny_lm, tiny_records):
    prompts = _prompts(tiny_records, 4)
    hot = [SamplingParams(max_new_tokens=20, temperature=3.0, seed=s) for s in range(4)]
    a = generate(tiny_lm.model, tiny_lm.tokenizer, prompts, hot)
    b = generate(tiny_lm.model, tiny_lm.tokenizer, prompts[1:2], hot[1:2])
    assert a[1].token_ids == b[0].token_ids
    c = generate(tiny_lm.model, tiny_lm.tokenizer, prompts, [SamplingParams(max_new_tokens=20, temperature=3.0,
                                                                           seed=s + 100) for s in range(4)])
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_top_k_one_is_greedy(tiny_lm, tiny_records):
    prompts = _prompts(tiny_records, 3)
    greedy = generate(tiny_lm.model, tiny_lm.tokenizer, prompts, GREEDY)
    k1 = generate(tiny_lm.model, tiny_lm.tokenizer, prompts, SamplingParams(max_new_tokens=40, temperature=5.0,
                                                                            top_k=1, seed=0))
    assert [g.token_ids for g in greedy] == [k.token_ids for k in k1]


def test_logits_to_probs_matches_an_independent_top_k_top_p():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.7])
    top_k = torch.tensor([0, 5, 0, 10, 3])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 1.0])
    got = logits_to_probs(logits, temperature, top_k, top_p)
    for i in range(5):
        p = torch.softmax(logits[i] / temperature[i], -1)
        order = p.argsort(descending=True).tolist()
        keep = order[: top_k[i].item() or 50]
        kp = p[keep] / p[keep].sum()
        kept, mass = [], 0.0
        for tok, q in zip(keep, kp.tolist()):
            if mass >= top_p[i].item():
                break
            kept.append(tok)
            mass += q
        want = torch.zeros(50)
        want[kept] = p[kept] / p[kept].sum()
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)


def _join_and_drain(model, tok, prompts, params, rows, first: int) -> dict[int, list[int]]:
    """Decode the `first` prompts four steps, merge the others into that batch, then step it to the end, dropping
    rows as they finish (as the engine does): each prompt's tokens, by its index."""
    from lethe.heads.decoding.decode import Batch
    from lethe.heads.t3.guide import HeadGuide

    batch = Batch(model, tok, prompts[:first], params[:first], HeadGuide(rows[:first]))
    for _ in range(4):
        batch.step()
    batch.merge(Batch(model, tok, prompts[first:], params[first:], HeadGuide(rows[first:])))
    done, order = {}, list(range(len(prompts)))
    while not batch.done:
        batch.step()
        for i, r in zip(order, batch.rows):
            if r.finish_reason:
                done[i] = list(r.token_ids)
        order = [order[k] for k in batch.compact()]
    return done


def test_rows_joining_and_leaving_a_running_batch_decode_as_if_alone(tiny_lm, tiny_records):
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    head = T3Head(model.config.hidden_size, model.config.vocab_size, 4)
    torch.nn.init.normal_(head.up.weight, std=2.0)
    head.eval().requires_grad_(False)
    prompts = _prompts(tiny_records, 5)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (3, 30, 12, 25, 8)]
    rows = [None, (head, TiltSettings()), None, (head, TiltSettings(T=2.0, cap=None)), None]
    done = _join_and_drain(model, tok, prompts, params, rows, first=2)
    assert sorted(done) == [0, 1, 2, 3, 4]
    for i in range(5):
        alone = generate(model, tok, [prompts[i]], params[i], HeadGuide([rows[i]]))[0]
        assert done[i] == alone.token_ids, i


def test_the_decode_loop_hands_the_tokenizers_words_to_a_guide_whose_rows_guard_words(tiny_lm, tiny_records):
    # the word guard reads which tokens continue a word (`WordClasses.joins`): the loop gives them to a guide with a
    # guarding row, also one that joins a running batch, and spares a guide without one the tokenizer's pass
    from lethe.heads.decoding.decode import Batch
    from lethe.heads.decoding.repeats import word_classes
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    head = T3Head(model.config.hidden_size, model.config.vocab_size, 4).eval().requires_grad_(False)
    prompts, params = _prompts(tiny_records, 2), [SamplingParams(max_new_tokens=4, temperature=0.0)] * 2
    unguarded = Batch(model, tok, prompts[:1], params[:1], HeadGuide([(head, TiltSettings(word_guard=False))]))
    assert unguarded.guide.words is None
    unguarded.step()
    unguarded.merge(Batch(model, tok, prompts[1:], params[1:], HeadGuide([None])))
    assert unguarded.guide.words is None
    unguarded.merge(Batch(model, tok, prompts[1:], params[1:], HeadGuide([(head, TiltSettings())])))
    joins = word_classes(tok).joins
    assert unguarded.guide.words is joins and bool(joins.any()) and not bool(joins.all())
    unguarded.step()
    unguarded.rows[0].finish_reason = "length"
    unguarded.compact()  # a finished row leaves: the guide of the rows kept keeps the words
    assert unguarded.guide.words is joins
    assert Batch(model, tok, prompts[:1], params[:1], HeadGuide.uniform(head, TiltSettings())).guide.words is joins
    # a word's first token (after a space) and punctuation start a word; the word's other pieces continue it
    ids = tok(" The capital identifies Dredrougpbinary.", add_special_tokens=False)["input_ids"]
    texts = [tok.decode([i]) for i in ids]
    assert [bool(joins[i]) for i in ids] == [t[0].isalnum() for t in texts] and texts[-1] == "."
    assert sum(joins[i] for i in ids) >= 2 and not any(joins[i] for i in tok.all_special_ids)
    # a word spelled in bytes (a Cyrillic name on a byte-level vocabulary): its pieces are parts of a character, which
    # the whole-words lookahead counts as going on spelling; whole words and punctuation are not
    partial = word_classes(tok).partial
    cyrillic = tok(" Россия", add_special_tokens=False)["input_ids"]
    assert len(cyrillic) > 2 and all(partial[i] for i in cyrillic[1:]) and not any(partial[i] for i in ids)


def test_sticky_gates_follow_their_rows_as_rows_join_and_leave_a_running_batch(tiny_lm, tiny_records):
    # each row's floor (the highest gate its answer has had) must stay with that row when the batch merges new
    # rows in and drops finished ones: every row then decodes as it would alone
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    torch.manual_seed(7)
    head = T3Head(model.config.hidden_size, model.config.vocab_size, 4)
    torch.nn.init.normal_(head.up.weight, std=2.0)
    torch.nn.init.normal_(head.probe.weight, std=0.4)  # gates that open and close along an answer
    head.eval().requires_grad_(False)
    prompts = _prompts(tiny_records, 6)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 30, 12, 25, 8, 20)]
    sticky, plain = TiltSettings(sticky_gate=True, repeat_guard=0), TiltSettings(sticky_gate=False, repeat_guard=0)
    rows = [None, (head, sticky), (head, plain), (head, sticky), None, (head, sticky)]
    done = _join_and_drain(model, tok, prompts, params, rows, first=3)
    assert sorted(done) == list(range(6))
    differs = 0
    for i in range(6):
        alone = generate(model, tok, [prompts[i]], params[i], HeadGuide([rows[i]]))[0]
        assert done[i] == alone.token_ids, i
        if rows[i] is not None and rows[i][1].sticky_gate:
            differs += alone.token_ids != generate(model, tok, [prompts[i]], params[i], HeadGuide([(head, plain)]))[
                0].token_ids
    assert differs > 0  # the floors changed some answer: carrying them wrongly would show


def test_one_guide_reused_for_batch_after_batch_starts_each_with_no_gate_opened(tiny_lm, tiny_records):
    # an evaluation decodes chunk after chunk of prompts with one guide (`generate_chunked`, a uniform guide): the
    # sticky floors one batch's rows leave must not open the gates of the next batch's rows in their places
    from lethe.heads.decoding.decode import generate_chunked
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    torch.manual_seed(7)
    head = T3Head(model.config.hidden_size, model.config.vocab_size, 4)
    torch.nn.init.normal_(head.up.weight, std=2.0)
    torch.nn.init.normal_(head.probe.weight, std=1.0)  # gates that open for some prompts' answers, not others'
    torch.nn.init.constant_(head.probe.bias, -1.5)  # P(forget) = sigmoid(-probe)
    head.eval().requires_grad_(False)
    settings = TiltSettings(sticky_gate=True, repeat_guard=0, flagged_mass=0.0)
    prompts = _prompts(tiny_records, 8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    for fused in (True, False):
        floors = []
        for p in prompts:
            guide = HeadGuide.uniform(head, settings, fused)
            generate(model, tok, [p], params, guide)
            floors.append(float(guide.floor[0]))
        high, low = max(range(8), key=floors.__getitem__), min(range(8), key=floors.__getitem__)
        assert floors[high] > 0.5 > floors[low]  # one prompt's answer opens the gate, another's never does
        guide = HeadGuide.uniform(head, settings, fused)
        generate(model, tok, [prompts[high]], params, guide)
        generate(model, tok, [prompts[low]], params, guide)
        assert float(guide.floor[0]) == floors[low], fused
        shared = generate_chunked(model, tok, prompts, params, batch_size=2, guide=guide)
        alone = [generate(model, tok, [p], params, HeadGuide.uniform(head, settings, fused))[0] for p in prompts]
        assert [c.token_ids for c in shared] == [c.token_ids for c in alone], fused


def test_engine_frees_the_row_of_a_client_that_went_away(tiny_lm):
    from lethe.server.engine import Engine, Pending

    engine = Engine(tiny_lm, max_batch_size=4)
    try:
        params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
        leaving = Pending("Question: Who?\nAnswer:", params)
        leaving.on_text = lambda _t, _lp: leaving.cancelled.set()  # the client leaves after its first text
        staying = Pending("Question: Who?\nAnswer:", params)
        engine.submit(leaving)
        engine.submit(staying)
        gone, kept = leaving.future.result(timeout=60), staying.future.result(timeout=60)
        assert gone.finish_reason == "abort" and gone.completion_tokens < 10
        assert kept.finish_reason == "length" and kept.completion_tokens == 200
    finally:
        engine.close()


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_lookahead_gives_the_logits_feeding_the_token_would_and_leaves_the_batch_as_it_was(tiny_lm, tiny_records,
                                                                                              side_by_side,
                                                                                              monkeypatch):
    # `TorchRows.peek` (the whole-words lookahead) feeds one row's candidates on a copy of its cache (side by side
    # in one pass where the model takes a custom mask, else a copy per candidate): each result equals the logits the
    # row gets when that token is really fed, and the batch then decodes as if nothing happened
    from lethe.heads.decoding.decode import Batch
    from lethe.heads.t3 import cache as cache_module

    monkeypatch.setattr(cache_module, "packs", lambda model: side_by_side)

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    prompts = _prompts(tiny_records, 2) + ["Question: Who?\nAnswer:"]  # lengths differ: left padding
    params = [SamplingParams(max_new_tokens=6, temperature=0.0)] * 3
    batch = Batch(model, tok, prompts, params)
    batch.step()
    rows, tokens = [2, 0, 2, 1], torch.tensor([5, 17, 29, 17])  # row 2: the shortest prompt, left-padded
    with torch.inference_mode():
        ahead = batch.runner.peek(rows, tokens)
    for row, token, got in zip(rows, tokens.tolist(), ahead):
        ids = tok(prompts[row], add_special_tokens=False)["input_ids"] + batch.rows[row].token_ids + [token]
        with torch.inference_mode():
            want = model(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    while not batch.done:
        batch.step()
    for prompt, row in zip(prompts, batch.rows):
        assert row.token_ids == generate(model, tok, [prompt], params[0])[0].token_ids


@pytest.mark.parametrize("side_by_side", [True, False])
def test_lookahead_passes_keep_their_copies_of_row_caches_within_the_budget(side_by_side):
    # a row's candidates fed side by side share one copy of its cache; fed one a row, each takes a copy: the passes
    # hold as many items as the budget (here two copies) allows, in order
    from types import SimpleNamespace

    from lethe.heads.decoding.decode import LOOKAHEAD_BYTES, Batch

    def passes(per):
        runner = SimpleNamespace(row_bytes=lambda: per, side_by_side=lambda: side_by_side)
        return Batch._lookahead_passes(SimpleNamespace(runner=runner), items)

    items = [(0, 11), (0, 12), (0, 13), (1, 14), (2, 15)]
    within, over = passes(LOOKAHEAD_BYTES // 2), passes(LOOKAHEAD_BYTES + 1)  # two copies a pass; less than one
    assert [item for part in within for item in part] == items
    if side_by_side:  # a row's items stay in one pass even where its one copy is over the budget
        assert within == [items[:4], items[4:]] and over == [items[:3], items[3:4], items[4:]]
    else:
        assert within == [items[:2], items[2:4], items[4:]] and over == [[item] for item in items]


def test_a_step_with_nothing_to_look_ahead_at_runs_no_pass(tiny_lm, tiny_records, monkeypatch):
    from lethe.heads.decoding.decode import Batch

    batch = Batch(tiny_lm.model, tiny_lm.tokenizer, _prompts(tiny_records, 1),
                  [SamplingParams(max_new_tokens=2, temperature=0.0)])
    monkeypatch.setattr(batch.runner, "peek", lambda rows, tokens: pytest.fail("a pass with no items"))
    assert batch._look_ahead([]) == []


def _turned_case(model, tok, prompts, joins, goes_on):
    """Token ids (a question and the first tokens of the base model's greedy answer) after which the likeliest token
    starts a word (the head will flag it), with the other word starts among the base model's 20 likeliest next
    tokens (the first 8) and the probability that the base model ends each one's word right after it: the first
    place, along the greedy answers, where the likeliest other start would go on spelling and a later one would
    end its word."""
    for prompt in prompts:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        for _ in range(12):
            with torch.inference_mode():
                order = model(torch.tensor([ids])).logits[0, -1].float().argsort(descending=True)[:20].tolist()
            starts = [t for t in order[1:] if not joins[t]][:8]
            if not joins[order[0]] and starts:
                with torch.inference_mode():
                    nxt = model(torch.tensor([ids + [t] for t in starts])).logits[:, -1].float().softmax(-1)
                ends = (nxt[:, : len(joins)] * ~goes_on).sum(-1).tolist()
                if ends[0] < 0.5 and max(ends) >= 0.5:
                    return ids, order[0], starts, ends
            ids = ids + [order[0]]
    raise AssertionError("no greedy answer of the tiny model has a word whose next best start goes on spelling")


@pytest.mark.parametrize("path", ["fused", "candidates", "dense"])
def test_whole_words_replaces_a_flagged_word_with_a_start_the_model_ends_as_a_word(tiny_lm, tiny_records, path):
    # a head that flags the base model's likeliest first word: the cap turns it away, and the next best start is
    # one the model would go on spelling (a fragment); with whole_words the row takes the best start whose word
    # the model ends at the next token instead, and the flagged word stays under it
    from lethe.heads.decoding.decode import Batch
    from lethe.heads.decoding.repeats import word_classes
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    joins = word_classes(tok).joins
    prompts = [question_prompt(r["question"]) for r in tiny_records[::7]]
    prompt, top, starts, ends = _turned_case(model, tok, prompts, joins, joins | word_classes(tok).partial)
    head = T3Head(model.config.hidden_size, model.config.vocab_size, 4).eval().requires_grad_(False)
    probe = Batch(model, tok, [prompt], [SamplingParams(max_new_tokens=1, temperature=0.0)])
    u = head.down(probe.pooled())[0]
    head.up.weight.zero_()
    head.up.weight[top] = -10 * u / u.dot(u)  # z = -10 for the likeliest token, 0 (not flagged) for every other
    head.probe.weight.zero_()
    head.probe.bias.fill_(-10.0)  # the probe calls every context forget-like: the gate is open
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    chosen = {}
    for on in (False, True):
        settings = TiltSettings(whole_words=on, repeat_guard=0, candidates=0 if path == "dense" else 20)
        guide = HeadGuide([(head, settings)], fused=path == "fused")
        chosen[on] = generate(model, tok, [prompt], greedy, guide)[0].token_ids[0]
    assert chosen[False] == starts[0]  # the tilt's own choice: the next best start, a fragment
    assert chosen[True] == next(t for t, e in zip(starts, ends) if e >= 0.5) and chosen[True] != top
