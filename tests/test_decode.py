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
