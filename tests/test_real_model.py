"""Issue 12 on the real model, SmolLM2-135M-Instruct as llama.cpp users have it (a Q4_1 GGUF file)."""

from __future__ import annotations

import pytest
import torch

from conftest import REAL_GGUF, REAL_MODEL

pytestmark = pytest.mark.real


def test_the_gguf_file_and_its_prepared_directory_are_one_model(real_lm):
    """Same logits and the same fingerprint: a head trained against either loads against the other."""
    from heads.modelio import ModelLoadError, load_model
    from heads.t3.head import HeadInfo, T3Head, load_head, save_head

    gguf = load_model(REAL_GGUF)
    assert gguf.fingerprint == real_lm.fingerprint
    ids = real_lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
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
        from heads.modelio import gguf_file

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
