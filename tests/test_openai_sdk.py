"""The OpenAI endpoints driven only through the official `openai` SDK, as vLLM users and evaluation harnesses
(lm-evaluation-harness, open-unlearning's evaluators) drive them: errors as the SDK's own exceptions, `n`,
logprobs (tilted, untilted, the prompt's), token-id prompts fed exactly, content parts, streamed choices and
usage, `models.retrieve`, and which profile version answered. Setting a tenant up (a head, a profile) uses the
native API; every check is made through the SDK."""

import json
import math
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from lethe.heads.demo.corpus import split_by_author
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from live_server import new_tenant, running_server


@pytest.fixture(scope="module")
def base_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    lm = load_model(tiny_model_dir)
    with running_server(lm, tmp_path_factory.mktemp("data"), max_new_tokens_limit=128, max_queue=64) as url:
        yield url


@pytest.fixture(scope="module")
def tenant(live, tiny_records):
    """A tenant with profile `forget` (a head that forgets one author) and its SDK client."""
    native = new_tenant(live, "sdk")
    forget, retain = split_by_author(tiny_records, 1)

    def upload(records) -> str:
        body = "".join(json.dumps(r) + "\n" for r in records).encode()
        return native.post("/v1/datasets", content=body).json()["id"]

    job = native.post("/v1/heads", json={"forget": upload(forget), "retain": upload(retain)}).json()
    for _ in range(600):
        state = native.get(f"/v1/jobs/{job['id']}").json()
        if state["status"] in ("succeeded", "failed"):
            break
        time.sleep(0.1)
    assert state["status"] == "succeeded", state
    assert native.put("/v1/profiles/forget", json={"head": state["head"]}).status_code == 200
    key = native.headers["Authorization"].split()[1]
    return {"sdk": OpenAI(base_url=live + "/v1", api_key=key, max_retries=0), "forget": forget, "retain": retain}


def _base_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """The base model's log-probabilities of ids[1:], computed here with transformers, independently of Lethe."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_errors_are_the_sdks_own_exceptions_with_the_servers_message(live, tenant):
    sdk = tenant["sdk"]
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="base", prompt="Question: Who?\nAnswer:", max_tokens=2, temperature=7)
    assert e.value.status_code == 400 and e.value.param == "temperature" and "temperature" in str(e.value)
    for refused in ({"logit_bias": {"5": 10}}, {"suffix": "end"}, {"best_of": 3},
                    {"extra_body": {"repetition_penalty": 1.3}}):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model="base", prompt="Question: Who?\nAnswer:", max_tokens=2, **refused)
        name = next(iter(refused.get("extra_body", refused)))
        assert e.value.param == name and "not supported" in str(e.value), refused
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="no-such-profile", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "no-such-profile" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=live + "/v1", api_key="lk_not-a-key", max_retries=0).models.list()
    # the usual placeholder key of local servers is anonymous: the base model answers, a profile is refused
    anonymous = OpenAI(base_url=live + "/v1", api_key="EMPTY", max_retries=0)
    assert anonymous.completions.create(model="base", prompt="Question: Who?\nAnswer:", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model="forget", prompt="Question: Who?\nAnswer:", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert e.value.param == "top_logprobs"


def test_logprobs_of_the_base_model_are_the_models_own(tenant, base_lm):
    sdk = tenant["sdk"]
    prompt = question_prompt(tenant["retain"][0]["question"])
    out = sdk.completions.create(model="base", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    choice = out.choices[0]
    lp, generated = choice.logprobs, out.usage.completion_tokens
    # one entry per token of the text, and one for the end-of-text token when the answer ended with it
    assert len(lp.tokens) == generated + (choice.finish_reason == "stop")
    assert "".join(lp.tokens[:generated]) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    prompt_ids = base_lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + base_lm.tokenizer(choice.text, add_special_tokens=False)["input_ids"]
    expected = _base_logprobs(base_lm, ids)[len(prompt_ids) - 1:]
    assert torch.allclose(torch.tensor(lp.token_logprobs[:generated]), expected, atol=1e-4)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value  # greedy: the chosen token is the likeliest
        assert value == max(top.values())
    chat = sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "Who?"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content).lstrip() == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert all(bytes(c.bytes).decode() == c.token for c in content)


def test_logprobs_under_a_profile_are_the_tilted_distribution_and_untilted_ones_come_on_request(tenant, base_lm):
    sdk = tenant["sdk"]
    prompt = question_prompt(tenant["forget"][0]["question"])
    base = sdk.completions.create(model="base", prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
    out = sdk.completions.create(model="forget", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                 extra_body={"lethe_untilted_logprobs": True})
    choice = out.choices[0]
    assert choice.text != base.choices[0].text  # the profile changes the answer
    tilted = choice.logprobs
    untilted = choice.model_extra["lethe_untilted_logprobs"]
    assert untilted["tokens"] == tilted.tokens
    assert len(tilted.tokens) == out.usage.completion_tokens + (choice.finish_reason == "stop")
    # greedy under the profile: every chosen token is the likeliest of the distribution it was drawn from ...
    assert all(v == max(top.values()) for v, top in zip(tilted.token_logprobs, tilted.top_logprobs))
    # ... which is not the base model's: somewhere the base model preferred another token
    assert any(v < max(top.values()) - 1e-6 for v, top in zip(untilted["token_logprobs"], untilted["top_logprobs"]))
    prompt_ids = base_lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + base_lm.tokenizer(choice.text, add_special_tokens=False)["input_ids"]
    expected = _base_logprobs(base_lm, ids)[len(prompt_ids) - 1:]
    if len(expected) == out.usage.completion_tokens:  # the text re-tokenizes as it was generated
        assert torch.allclose(torch.tensor(untilted["token_logprobs"][:len(expected)]), expected, atol=1e-4)
    # the chat route gives the same two views
    chat = sdk.chat.completions.create(model="forget", messages=[{"role": "user", "content": "Who?"}], max_tokens=4,
                                       temperature=0, logprobs=True, extra_body={"lethe_untilted_logprobs": True})
    assert len(chat.choices[0].model_extra["lethe_untilted_logprobs"]["content"]) == len(chat.choices[0].logprobs.content)


def test_prompt_logprobs_as_lm_evaluation_harness_asks_for_them_on_token_ids_fed_exactly(tenant, base_lm):
    """lm-evaluation-harness's loglikelihood: token ids, echo, logprobs=1, max_tokens 0 (or 1), temperature 0."""
    sdk, tok = tenant["sdk"], base_lm.tokenizer
    record = tenant["retain"][1]
    context = tok(question_prompt(record["question"]), add_special_tokens=False)["input_ids"]
    continuation = tok(" " + record["answer"], add_special_tokens=False)["input_ids"]
    ids = context + continuation
    out = sdk.completions.create(model="base", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), _base_logprobs(base_lm, ids), atol=1e-4)
    assert out.choices[0].text == tok.decode(ids)
    # ids that are not the canonical tokenization of their text are fed as given, never re-tokenized
    spelled = [t for word in ("Question", ":") for t in tok(word, add_special_tokens=False)["input_ids"]]
    odd = [t for ch in "Question" for t in tok(ch, add_special_tokens=False)["input_ids"]] + spelled[-1:]
    assert odd != tok(tok.decode(odd), add_special_tokens=False)["input_ids"]
    out = sdk.completions.create(model="base", prompt=odd, max_tokens=1, echo=True, logprobs=0, temperature=0)
    assert out.usage.prompt_tokens == len(odd) and out.choices[0].logprobs.tokens[:len(odd)] == [tok.decode([t]) for t in odd]
    assert torch.allclose(torch.tensor(out.choices[0].logprobs.token_logprobs[1:len(odd)]),
                          _base_logprobs(base_lm, odd), atol=1e-4)
    # under a profile, every prompt token keeps a finite log-probability (the whole vocabulary is scored)
    forgotten = tok(question_prompt(tenant["forget"][0]["question"]) + " " + tenant["forget"][0]["answer"],
                    add_special_tokens=False)["input_ids"]
    scored = sdk.completions.create(model="forget", prompt=forgotten, max_tokens=0, echo=True, logprobs=1)
    values = scored.choices[0].logprobs.token_logprobs[1:]
    assert all(math.isfinite(v) and v > -1000 for v in values)
    unscored = sdk.completions.create(model="base", prompt=forgotten, max_tokens=0, echo=True, logprobs=1)
    assert sum(values) < sum(unscored.choices[0].logprobs.token_logprobs[1:])  # the forgotten answer is less likely
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="base", prompt=ids, max_tokens=0)
    assert e.value.param == "max_tokens"
    # lm-evaluation-harness's exact request, a batch of token-id prompts, and its parsing: token_logprobs[ctxlen:-1]
    # must be the continuation's, so the one generated token is always last, the end-of-text token included
    batch = [ids, context + tok(" Nobody", add_special_tokens=False)["input_ids"]]
    out = sdk.completions.create(model="base", prompt=batch, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                                 echo=True)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.prompt_tokens == sum(map(len, batch))
    for request_ids, choice in zip(batch, out.choices):
        lp = choice.logprobs
        assert len(lp.tokens) == len(request_ids) + 1
        continuation_logprobs = lp.token_logprobs[len(context):-1]
        assert torch.allclose(torch.tensor(continuation_logprobs),
                              _base_logprobs(base_lm, request_ids)[len(context) - 1:], atol=1e-4)
    # the record's answer is what the model learnt: greedy at every continuation token, then the end of the text
    top = out.choices[0].logprobs.top_logprobs
    assert all(max(top[i], key=top[i].get) == out.choices[0].logprobs.tokens[i] for i in range(len(context), len(ids)))
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == tok.decode(ids)


def test_what_the_independent_tester_found(live, tenant, base_lm):
    sdk = tenant["sdk"]
    for bad in ({"prompt": [True, False, 2]}, {"prompt": "hi", "logprobs": True}, {"prompt": "hi", "logprobs": "3"},
                {"prompt": "hi", "stream_options": {"include_usage": True}},
                {"prompt": "hi", "stream": True, "logprobs": 1, "lethe_untilted_logprobs": True},
                {"prompt": ["a", "b", "c"], "n": 12}):  # 36 choices: more than the 32 rows a tenant may have in flight
        body = {"model": "base", "max_tokens": 2, **bad}
        r = httpx.post(live + "/v1/completions", json=body, headers={"Authorization": f"Bearer {sdk.api_key}"})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] in bad, (bad, r.text)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                    top_logprobs="2")
    assert e.value.param == "top_logprobs"
    # usage counts each prompt once, however many choices it has
    one = sdk.completions.create(model="base", prompt="Question: Where", max_tokens=2)
    four = sdk.completions.create(model="base", prompt="Question: Where", max_tokens=2, n=4)
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    # a stream's text offsets go on from chunk to chunk, as the non-streamed answer's
    whole = sdk.completions.create(model="base", prompt="Question: Where", max_tokens=8, logprobs=0, temperature=0)
    offsets = [o for chunk in sdk.completions.create(model="base", prompt="Question: Where", max_tokens=8,
                                                     logprobs=0, temperature=0, stream=True)
               for c in chunk.choices if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    # a token's bytes are its own, where its text alone is part of a character (U+FFFD)
    from lethe.heads.decoding.logprobs import token_bytes

    tok = base_lm.tokenizer
    ids = tok("Zürich 東京 🙂", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    assert b"".join(token_bytes(tok, t) for t in ids) == "Zürich 東京 🙂".encode()


def test_n_choices_content_parts_and_streams_of_several_choices(tenant, base_lm):
    sdk = tenant["sdk"]
    prompt = question_prompt(tenant["retain"][2]["question"])
    settings = {"model": "base", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    whole = sdk.completions.create(prompt=prompt, n=3, **settings)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) > 1
    texts, finishes, usage, logged = {}, {}, None, {}
    for chunk in sdk.completions.create(prompt=prompt, n=3, stream=True, logprobs=1,
                                        stream_options={"include_usage": True}, **settings):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            logged.setdefault(c.index, []).extend(c.logprobs.tokens if c.logprobs else [])
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert texts == {c.index: c.text for c in whole.choices}  # streamed and whole answers are the same text
    eos = base_lm.tokenizer.eos_token  # an answer that ended with it lists it last in its logprobs, not in its text
    assert {i: "".join(tokens).removesuffix(eos if finishes[i] == "stop" else "") for i, tokens in logged.items()} == texts
    assert set(finishes) == {0, 1, 2} and all(finishes.values())
    assert usage.completion_tokens == whole.usage.completion_tokens
    # chat: content as a list of text parts, and an assistant turn that only called a tool
    plain = sdk.chat.completions.create(model="base", max_tokens=6, temperature=0,
                                        messages=[{"role": "user", "content": "Who wrote it?"}])
    parts = sdk.chat.completions.create(model="base", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Who wrote "}, {"type": "text", "text": "it?"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    tool_turn = sdk.chat.completions.create(model="base", max_tokens=4, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "and?"}])
    assert tool_turn.choices[0].finish_reason in ("stop", "length")
    roles, chat_texts = {}, {}
    for chunk in sdk.chat.completions.create(model="forget", messages=[{"role": "user", "content": "Who?"}], n=2,
                                             stream=True, max_tokens=6, temperature=1.0, seed=3):
        for c in chunk.choices:
            roles[c.index] = roles.get(c.index, 0) + (c.delta.role == "assistant")
            chat_texts[c.index] = chat_texts.get(c.index, "") + (c.delta.content or "")
    whole_chat = sdk.chat.completions.create(model="forget", messages=[{"role": "user", "content": "Who?"}], n=2,
                                             max_tokens=6, temperature=1.0, seed=3)
    assert roles == {0: 1, 1: 1}  # the role once per choice
    assert chat_texts == {c.index: c.message.content for c in whole_chat.choices}


def test_models_and_the_profile_version_that_answered(tenant):
    sdk = tenant["sdk"]
    assert {m.id for m in sdk.models.list()} >= {"base", "forget"}
    assert sdk.models.retrieve("forget").id == "forget"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("nothing-here")
    raw = sdk.chat.completions.with_raw_response.create(model="forget", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["X-Lethe-Profile"] == "forget" and raw.headers["X-Lethe-Profile-Version"] == "1"
    assert raw.parse().model_extra["lethe_profile"] == {"name": "forget", "version": 1}


def test_a_body_that_is_not_json_is_named_so_not_as_a_field(live):
    r = httpx.post(live + "/v1/completions", content=b'{"model": "base", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "not valid JSON" in r.json()["error"]["message"]
