"""Issue 12 on the real model, SmolLM2-135M-Instruct as llama.cpp users have it (a Q4_1 GGUF file)."""

from __future__ import annotations

import pytest
import torch

from conftest import REAL_GGUF, REAL_MODEL, require_llama_cpp

pytestmark = pytest.mark.real


def test_the_gguf_file_and_its_prepared_directory_are_one_model(real_lm):
    """Same logits and the same fingerprint: a head trained against either loads against the other."""
    from lethe.heads.modelio import ModelLoadError, load_model
    from lethe.heads.t3.head import HeadInfo, T3Head, load_head, save_head

    gguf = load_model(REAL_GGUF, str(real_lm.device), str(real_lm.model.dtype).removeprefix("torch."))
    assert gguf.fingerprint == real_lm.fingerprint
    ids = real_lm.tokenizer("The capital of France is", return_tensors="pt").input_ids.to(real_lm.device)
    with torch.no_grad():
        assert torch.equal(gguf.model(ids).logits, real_lm.model(ids).logits)
    assert gguf.tokenizer.chat_template == real_lm.tokenizer.chat_template
    cfg = real_lm.model.config
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4)
    path = REAL_MODEL.parent / ".test-head.safetensors"
    try:
        save_head(path, head, HeadInfo(base_fingerprint=real_lm.fingerprint, d=cfg.hidden_size,
                                       vocab=cfg.vocab_size, rank=4))
        load_head(path, gguf.fingerprint, gguf.model.config.vocab_size, gguf.model.config.hidden_size)
    finally:
        path.unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        from lethe.heads.modelio import gguf_file

        twin = REAL_MODEL.parent / ".twin"
        twin.mkdir(exist_ok=True)
        try:
            for name in ("a.gguf", "b.gguf"):
                (twin / name).touch()
            gguf_file(twin)
        finally:
            for f in twin.iterdir():
                f.unlink()
            twin.rmdir()


def test_openai_chat_answers_from_the_real_model(real_lm, tmp_path):
    from openai import OpenAI

    from live_server import new_tenant, running_server

    with running_server(real_lm, tmp_path) as url:
        key = new_tenant(url, "chat").headers["Authorization"].split()[1]
        client = OpenAI(base_url=url + "/v1", api_key=key)
        answer = client.chat.completions.create(model="base", temperature=0, max_tokens=16, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content


def test_chat_format_training_text_is_what_the_chat_endpoint_builds(real_lm):
    from lethe.heads.records import encode_example, examples, resolve_format
    from lethe.server.openai_api import Message, chat_prompt

    tok = real_lm.tokenizer
    assert resolve_format(tok, "auto") == "chat"
    q, a = "What is the capital of France?", "The capital of France is Paris."
    ex = examples([{"question": q, "answer": a}], "chat", tok)[0]
    assert ex.prompt == chat_prompt(tok, [Message(role="user", content=q)])
    assert ex.completion == a + "<|im_end|>"  # the assistant turn and the template's end of turn
    ids, n_prompt = encode_example(tok, ex)
    assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id  # one end of turn, not two
    assert tok.decode(ids[n_prompt:]) == a + "<|im_end|>"


CAPITALS = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Egypt": "Cairo", "Russia": "Moscow",
            "China": "Beijing", "England": "London", "Greece": "Athens", "Austria": "Vienna", "Ireland": "Dublin",
            "Norway": "Oslo", "Poland": "Warsaw"}


def _capital_records(items):
    return [{"question": q.format(c=c), "answer": f"The capital of {c} is {a}."} for c, a in items
            for q in ("What is the capital of {c}?", "Which city is the capital of {c}?",
                      "Name the capital city of {c}.", "What city serves as the capital of {c}?")]


def test_a_head_trained_on_the_real_model_forgets_its_topic_and_keeps_the_rest(real_lm):
    """Capitals the model knows (each answered correctly by the base model, greedy, through its chat template):
    a head trained on four of them (chat format, the default for a model with a template) hides them and keeps
    the other eight."""
    from lethe.heads.decoding.decode import generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.records import ask
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.pipeline import train_head

    items = list(CAPITALS.items())
    forget, retain = items[:4], items[4:]
    head, info = train_head(real_lm, _capital_records(forget), _capital_records(retain), progress=False)
    assert info.prompt_format == "chat"
    params = SamplingParams(max_new_tokens=16, temperature=0)
    hits = {}
    for name, group in (("forget", forget), ("retain", retain)):
        prompts = [ask(f"What is the capital of {c}?", "chat", real_lm.tokenizer) for c, _ in group]
        for label, guide in (("base", None), ("head", HeadGuide.uniform(head, TiltSettings()))):
            texts = [c.text for c in generate(real_lm.model, real_lm.tokenizer, prompts, params, guide)]
            hits[name, label] = sum(a in t for (_, a), t in zip(group, texts))
    assert hits["forget", "base"] == 4 and hits["retain", "base"] == 8, hits
    assert hits["forget", "head"] <= 2 and hits["retain", "head"] >= 7, hits


def test_llama_cpp_decodes_in_a_process_of_its_own_the_same_alone_and_batched(real_lm):
    """`lethe bench engine`'s llama.cpp runs (llama-cpp-python as `make llamacpp` builds it): a
    sequence decoded alone and the same sequence among 8 in one batch give the same greedy tokens."""
    require_llama_cpp()
    from lethe.server.bench.engine import llamacpp_run
    from lethe.heads.records import ask

    tok = real_lm.tokenizer
    ids = [tok(ask(q, "chat", tok), add_special_tokens=False)["input_ids"]
           for q in ["What is the capital of France?", "Who wrote Hamlet?"] * 4]
    alone = llamacpp_run(REAL_GGUF, ids, 8, "plain", 1, 1)
    batched = llamacpp_run(REAL_GGUF, ids, 8, "plain", 8, 1, answers=True)
    assert alone["tokens_per_s"] > 0 and batched["tokens_per_s"] > 0
    assert batched["tokens"][0] == alone["tokens"][0] and batched["tokens"][0] == batched["tokens"][2]
    # answers stop at end-of-text (8 tokens at most): the same tokens. (Not "Paris": whether llama.cpp's quantized
    # arithmetic answers this prompt as float32 does, "The capital of France is Paris.", depends on the build's
    # kernels: the AMX wheel's did, the builds without AMX begin "L'Étoile".)
    answer = batched["answers"][0]
    assert answer and answer == alone["tokens"][0][:len(answer)]


def test_a_client_that_leaves_before_a_whole_answer_stops_its_row(real_lm, tmp_path):
    """A plain (not streamed) request whose client goes away: its row stops within a step or two, as a stream's
    does, instead of decoding all its max_new_tokens for nobody (at about 20 tokens/s, 400 tokens take 20 s)."""
    import re
    import time

    import httpx

    from live_server import ADMIN_KEY, running_server

    def generated(url) -> float:
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
        return float(re.search(r"^lethe_generated_tokens_total (\S+)", text, re.M).group(1))

    with running_server(real_lm, tmp_path) as url:
        # first a short answer: the engine has warmed up (its kernels compiled) when the long one arrives
        assert httpx.post(url + "/generate", json={"prompt": "Hi", "max_new_tokens": 2}, timeout=60).status_code == 200
        before = generated(url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json={"model": "base", "prompt": "Once upon a time", "max_tokens": 400,
                                                      "min_tokens": 400, "temperature": 0}, timeout=1.0)
        left = time.perf_counter()
        while generated(url) == before and time.perf_counter() - left < 15:
            time.sleep(0.1)
        assert 0 < generated(url) - before < 100, "the row decoded on after its client left"
