"""The llama.cpp engine (issue 16) on the real model's GGUF file, as CI builds llama-cpp-python (`make llamacpp`):
a row decodes in a batch as it would alone, heads tilt per row, sequences are freed, and the server serves it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from conftest import REAL_GGUF, require_llama_cpp
from test_real_model import CAPITALS, _capital_records

pytestmark = pytest.mark.real

ROWS = 8


@pytest.fixture(scope="module")
def llama(real_lm):
    require_llama_cpp()
    from lethe.heads.decoding.llamacpp import open_gguf

    model = open_gguf(real_lm, REAL_GGUF, ROWS, 512)
    yield model
    model.close()


@pytest.fixture(scope="module")
def capitals_head(real_lm):
    """A head trained (on the transformers model, as the server's jobs train) to forget four capitals."""
    from lethe.heads.t3.pipeline import train_head

    items = list(CAPITALS.items())
    head, _ = train_head(real_lm, _capital_records(items[:4]), _capital_records(items[4:]), progress=False)
    return head


def _prompts(tok, countries):
    from lethe.heads.records import ask

    return [ask(f"What is the capital of {c}?", "chat", tok) for c in countries]


def test_a_row_decodes_in_a_batch_and_joining_one_as_it_would_alone(real_lm, llama, capitals_head):
    """Rows with their own heads, settings and sampling, one joining after three steps and one in the sequence a
    finished row left (so the batch's sequences are out of order): each row's tokens and log-probabilities are
    those it gets decoded alone, and every llama.cpp sequence is free afterwards."""
    from lethe.heads.decoding.decode import Batch, generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    tok = real_lm.tokenizer
    prompts = _prompts(tok, ["France", "Japan", "Italy", "Norway"])
    params = [SamplingParams(max_new_tokens=4, temperature=0, logprobs=2),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_new_tokens=12, temperature=0, prompt_logprobs=1),
              SamplingParams(max_new_tokens=12, temperature=0)]
    rows = [(capitals_head, TiltSettings()), None, (capitals_head, TiltSettings.from_dict({"T": 1.5, "lam": 2.0})),
            (capitals_head, TiltSettings())]
    alone = [generate(llama, tok, [p], [s], HeadGuide([r]) if r else None)[0] for p, s, r in zip(prompts, params, rows)]
    batch = Batch(llama, tok, prompts[:2], params[:2], HeadGuide(rows[:2]))
    for _ in range(3):
        batch.step()
    kept = list(batch.rows)  # finished rows leave the batch (compact): keep them to read their answers
    for i in (2, 3):  # the first joins after 3 steps; the second once the first row has left, in its sequence
        while i == 3 and len(batch.rows) == 3:
            batch.step()
            batch.compact()
        joining = Batch(llama, tok, prompts[i:i + 1], params[i:i + 1], HeadGuide(rows[i:i + 1]))
        assert batch.can_merge() and joining.can_merge()
        batch.merge(joining)
        kept += joining.rows
    assert batch.runner.seqs == [1, 2, 0], "the last row took the first row's sequence: out of order"
    while not batch.done:
        batch.step()
        batch.compact()
    batch.close()
    together = [r.completion() for r in kept]
    assert len(together) == len(alone)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs
    assert together[0].logprobs and together[2].prompt_logprobs
    assert sorted(llama.free) == list(range(ROWS))


def test_rows_with_long_prompts_decode_beside_each_other_as_they_would_alone(real_lm, llama):
    """Four questions after a 400-word document (464 tokens each, so the prompts go to llama.cpp in more than one
    call and every row attends over hundreds of keys): each row's tokens and log-probabilities are those it gets
    alone. With llama.cpp's flash attention (its default on CPU) they were not: its kernel depends on the batch's
    shape, and a row's logits moved by up to 1.0 beside the others."""
    from lethe.heads.decoding.decode import generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.server.bench.attacks import DOCUMENT

    tok = real_lm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": DOCUMENT}, {"role": "assistant", "content": "OK."},
                                        {"role": "user", "content": f"What is the capital of {c}?"}],
                                       tokenize=False, add_generation_prompt=True)
               for c in ("France", "Japan", "Italy", "Norway")]
    assert sum(len(tok(p)["input_ids"]) for p in prompts) > llama.per_call
    params = SamplingParams(max_new_tokens=16, temperature=0, logprobs=1)
    alone = [generate(llama, tok, [p], [params])[0] for p in prompts]
    together = generate(llama, tok, prompts, [params] * len(prompts))
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, (a.text, b.text)
    assert sorted(llama.free) == list(range(ROWS))


def test_a_head_hides_its_capitals_on_llama_cpp_and_keeps_the_others(real_lm, llama, capitals_head):
    """The head, trained on the transformers model's hidden states, tilts llama.cpp's answers as it does
    torch's: the forgotten capitals go (3 of 4 here, with 16 tokens), the others stay as the base model answers
    them."""
    from lethe.heads.decoding.decode import generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    items = list(CAPITALS.items())
    params = SamplingParams(max_new_tokens=16, temperature=0)
    hits, same = {}, []
    for name, group in (("forget", items[:4]), ("retain", items[4:])):
        prompts = _prompts(real_lm.tokenizer, [c for c, _ in group])
        base = generate(llama, real_lm.tokenizer, prompts, params)
        tilted = generate(llama, real_lm.tokenizer, prompts, params, HeadGuide.uniform(capitals_head, TiltSettings()))
        hits[name] = (sum(a in t.text for (_, a), t in zip(group, base)),
                      sum(a in t.text for (_, a), t in zip(group, tilted)))
        if name == "retain":
            same = [b.text == t.text for b, t in zip(base, tilted)]
    assert hits["forget"][0] >= 3 and hits["forget"][1] <= 1, hits  # torch's own test allows 2 of 4
    assert hits["retain"][1] == hits["retain"][0] >= 6 and sum(same) >= 7, (hits, same)


def test_the_server_decodes_with_llama_cpp(real_lm, llama, capitals_head, tmp_path):
    """`lethe serve --engine llamacpp`: a tenant's profile tilts its own answers and no one else's, streams work,
    the context is llama.cpp's, an ASU profile's adapter changes its tenant's answers alone, and ASU weights
    llama.cpp cannot apply (mode full) are refused naming them."""
    from lethe.heads.t3.head import HeadInfo, save_head

    from live_server import new_tenant, running_server

    cfg = real_lm.model.config
    save_head(tmp_path / "head.safetensors", capitals_head,
              HeadInfo(base_fingerprint=real_lm.fingerprint, d=cfg.hidden_size, vocab=cfg.vocab_size,
                       rank=capitals_head.rank))
    question = {"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "temperature": 0,
                "max_tokens": 16}
    with running_server(real_lm, tmp_path / "data", engine="llamacpp", gguf=REAL_GGUF, max_batch_size=ROWS,
                        max_model_len=256) as url:
        alice, bob = new_tenant(url, "alice"), new_tenant(url, "bob")
        head = alice.post("/v1/heads/upload", files={"file": ("h", (tmp_path / "head.safetensors").read_bytes())})
        assert head.status_code == 201, head.text
        assert alice.put("/v1/profiles/forget", json={"head": head.json()["id"]}).status_code == 200
        base = bob.post("/v1/chat/completions", json={**question, "model": "base"}).json()
        tilted = alice.post("/v1/chat/completions", json={**question, "model": "forget"}).json()
        again = bob.post("/v1/chat/completions", json={**question, "model": "base"}).json()
        answer = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
        assert "Berlin" in answer(base) and "Berlin" not in answer(tilted), (answer(base), answer(tilted))
        assert answer(again) == answer(base)
        with alice.stream("POST", "/v1/chat/completions", json={**question, "model": "forget", "stream": True}) as r:
            streamed = "".join(line for line in r.iter_lines() if line.startswith("data: {"))
        assert r.status_code == 200 and streamed
        version = httpx.get(url + "/version").json()
        assert version["max_model_len"] == 256 and version["engine"] == "llamacpp"
        long = alice.post("/generate", json={"prompt": "word " * 300, "max_new_tokens": 4})
        assert long.status_code == 422 and "256" in long.text
        # ASU on llama.cpp: alice's adapter changes her answers and no one else's, in one batch or apart
        from dataclasses import replace

        from lethe.heads.asu.weights import expected_tensors, projection_shapes, save_asu

        tensors, info = _random_asu(real_lm, ("q_proj", "k_proj", "v_proj", "o_proj"), scale=0.12)
        save_asu(tmp_path / "asu.safetensors", tensors, info)
        weights = alice.post("/v1/asu/upload", files={"file": ("w", (tmp_path / "asu.safetensors").read_bytes())})
        assert weights.status_code == 201, weights.text
        assert alice.put("/v1/profiles/asu", json={"backend": "asu", "weights": weights.json()["id"]}).status_code == 200
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda call: call[0].post("/v1/chat/completions", json={**question, **call[1]}),
                                    [(alice, {"model": "asu"}), (bob, {"model": "base"}), (alice, {"model": "asu"}),
                                     (alice, {"model": "forget"})]))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert answer(answers[0].json()) == answer(answers[2].json()) != answer(base), answer(answers[0].json())
        assert answer(answers[1].json()) == answer(base) and answer(answers[3].json()) == answer(tilted)
        # weights that change the projections themselves (mode full) are no LoRA adapter: refused, naming them
        full = replace(info, mode="full", full_layers=[29])
        save_asu(tmp_path / "full.safetensors", {n: torch.zeros(s) for n, s in expected_tensors(
            full, projection_shapes(real_lm.model)).items()}, full)
        weights = alice.post("/v1/asu/upload", files={"file": ("w", (tmp_path / "full.safetensors").read_bytes())})
        assert weights.status_code == 201, weights.text
        refused = alice.put("/v1/profiles/full", json={"backend": "asu", "weights": weights.json()["id"]})
        assert refused.status_code == 422 and "llama.cpp" in refused.text, refused.text
        assert refused.json()["detail"][0]["loc"][-1] == "weights"
        # an ASU job asking for a gate this engine could not serve is refused before it trains
        sets = [alice.post("/v1/datasets", content=json.dumps({"question": "Q?", "answer": "A."}) + "\n").json()["id"]
                for _ in range(2)]
        gated = alice.post("/v1/asu", json={"forget": sets[0], "retain": sets[1], "gate": True, "lora_layers": "20-29"})
        assert gated.status_code == 422 and gated.json()["detail"][0]["loc"][-1] == "gate", gated.text
        assert "llama.cpp" in gated.text


def test_bench_engine_times_the_llama_cpp_engine_beside_llama_cpp(llama, tmp_path):
    """`lethe bench engine` with the GGUF file: Lethe's llama.cpp engine with and without a head beside
    llama.cpp's own runs, the bars computed on it, and its answers the same batched as alone."""
    import json

    from lethe.clients.cli import main
    from test_real_model import REAL_MODEL

    records = _capital_records(list(CAPITALS.items()))
    for name, recs in (("forget", records[:16]), ("retain", records[16:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["bench", "engine", "--model", str(REAL_MODEL), "--gguf", str(REAL_GGUF), "--forget",
                 str(tmp_path / "forget.jsonl"), "--retain", str(tmp_path / "retain.jsonl"), "--repeats", "1",
                 "--new-tokens", "8", "--equality", "8", "--out", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    for batch in ("batch_1", "batch_8"):
        row = result["lethe"][batch]
        assert row["lethe_llamacpp_tokens_per_s"] > 0 and row["lethe_llamacpp_t3_tokens_per_s"] > 0
    assert result["bars"]["backend"] == "lethe_llamacpp_t3"
    assert all("error" not in r for r in result["llama_cpp"]["single_stream"]), "this build runs every mode"
    same = result["equality_lethe_llamacpp"]
    assert same["batched_vs_alone"]["equal"] == 8 and same["vs_llama_cpp"]["equal"] == 8, same


def test_the_gguf_file_must_be_the_models_own(real_lm, llama, tmp_path):
    """The llama.cpp engine decodes the model's own GGUF file, or the file its prepared directory came from:
    another file is refused in one line before any model loads, even one with the same name (by sha256, or for a
    directory prepared before the sha256 was recorded, by the weights' fingerprint)."""
    import dataclasses
    import json

    from pydantic import ValidationError

    from lethe.heads.decoding.llamacpp import LlamaCppError, gguf_for, open_gguf
    from lethe.server.settings import Settings
    from test_real_model import REAL_MODEL

    with pytest.raises(LlamaCppError, match="decodes a GGUF file"):
        gguf_for(REAL_MODEL, None)
    with pytest.raises(LlamaCppError, match="no such file"):
        gguf_for(REAL_MODEL, tmp_path / "missing.gguf")
    with pytest.raises(LlamaCppError, match="not a .gguf file"):
        gguf_for(REAL_MODEL, REAL_MODEL / "config.json")
    assert gguf_for(REAL_GGUF, None) == (REAL_GGUF, False) and gguf_for(REAL_GGUF, REAL_GGUF)[0] == REAL_GGUF
    # same name, other weights: a byte of the tensor data changed
    other = tmp_path / "other" / REAL_GGUF.name
    other.parent.mkdir()
    data = bytearray(REAL_GGUF.read_bytes())
    data[len(data) // 2] ^= 0xFF
    other.write_bytes(bytes(data))
    with pytest.raises(LlamaCppError, match="another sha256"):
        gguf_for(REAL_MODEL, other)
    # a directory prepared before the sha256 was recorded: the weights are compared
    old = tmp_path / "old-prepared"
    old.mkdir()
    for f in REAL_MODEL.iterdir():
        if f.name != "lethe_model.json":
            (old / f.name).symlink_to(f)
    record = json.loads((REAL_MODEL / "lethe_model.json").read_text())
    record.pop("source_sha256", None)
    (old / "lethe_model.json").write_text(json.dumps(record))
    assert gguf_for(old, other) == (other, True)
    with pytest.raises(LlamaCppError, match="its weights are not those"):
        open_gguf(dataclasses.replace(real_lm, path=old), other, 1, 64)
    with pytest.raises(ValidationError, match="give engine llamacpp"):
        Settings(gguf=REAL_GGUF)


def _random_asu(lm, targets, layers=range(20, 30), scale=0.05, seed=0):
    """(tensors, info) of an ASU LoRA adapter with random A and B, large enough to change answers."""
    import torch

    from lethe.heads.asu.weights import ASUInfo, expected_tensors, projection_shapes

    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=2.0, layers=list(layers), lora_rank=8, lora_alpha=16,
                   target_modules=list(targets), lora_layers=list(layers))
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale
            for n, s in expected_tensors(info, projection_shapes(lm.model)).items()}, info


@pytest.mark.parametrize("targets, scale", [(("q_proj", "k_proj"), 0.15), (("q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"), 0.05)])
def test_an_asu_adapter_moves_llama_cpp_as_it_moves_torch(real_lm, llama, targets, scale):
    """An ASU adapter written as llama.cpp's LoRA GGUF file (query and key rows permuted as the GGUF base holds
    them) moves llama.cpp's next-token logits as it moves the transformers model's: the two shifts point the same
    way (cosine > 0.95) and are of one size (within 25%), while the two bases differ by less than the shift.
    (Measured: cosine 0.997-0.999 on the query and key adapter; 0.48-0.74 with its rows left unpermuted. With
    llama.cpp's flash attention off, as the engine runs it, the adapter on all seven projections gave cosines
    0.979-0.995 and sizes 0.91-1.20, within 15% with it on. An
    adapter whose shift is no larger than the 4-bit base's own difference from float32 cannot be told apart.)"""
    import copy

    import torch

    from lethe.heads.asu.gguf import add_to_llama_cpp
    from lethe.heads.asu.weights import adapters, attach
    from lethe.heads.decoding.decode import TorchRows

    tok = real_lm.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in _prompts(tok, ["France", "Japan", "Italy", "Norway"])]
    tensors, info = _random_asu(real_lm, targets, scale=scale)
    add_to_llama_cpp(llama, "asu_test", tensors, info, real_lm.model.config)
    try:
        cpp = {}
        for name in (None, "asu_test"):
            rows = llama.start_rows(ids, [False] * len(ids), [name] * len(ids))
            cpp[name] = rows.logits().clone()
            rows.close()
    finally:
        llama.remove_adapter("asu_test")
    model = attach(copy.deepcopy(real_lm.model), "asu_test", tensors, info)
    ref = {}
    for name in ("__base__", "asu_test"):
        with torch.inference_mode(), adapters(model, [name] * len(ids)):
            ref[name] = TorchRows(model, ids, [False] * len(ids), tok.pad_token_id or 0).logits().clone()
    moved_cpp, moved_torch = cpp["asu_test"] - cpp[None], ref["asu_test"] - ref["__base__"]
    cosine = torch.nn.functional.cosine_similarity(moved_cpp, moved_torch, dim=1)
    sizes = moved_cpp.norm(dim=1) / moved_torch.norm(dim=1)
    assert (cosine > 0.95).all() and ((sizes - 1).abs() < 0.25).all(), (cosine, sizes)
    assert ((cpp[None] - ref["__base__"]).norm(dim=1) < moved_torch.norm(dim=1)).all()
    assert len(llama.free) == llama.rows and not llama.adapters


def test_asu_rows_decode_beside_base_and_head_rows_as_they_would_alone(real_lm, llama, capitals_head):
    """A batch mixing rows with an ASU adapter, base rows and a head row on llama.cpp, one row joining later:
    every row's tokens and log-probabilities are those it gets alone; the adapter changes its own rows' answers
    and no other row's."""
    from lethe.heads.asu.gguf import add_to_llama_cpp
    from lethe.heads.decoding.decode import Batch, generate
    from lethe.heads.decoding.sampling import SamplingParams
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    tok = real_lm.tokenizer
    prompts = _prompts(tok, ["France", "Japan", "Italy", "Norway"])
    params = [SamplingParams(max_new_tokens=12, temperature=0, logprobs=2),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_new_tokens=12, temperature=0, prompt_logprobs=1),
              SamplingParams(max_new_tokens=12, temperature=0)]
    names = ["asu_test", "__base__", "asu_test", "__base__"]
    rows = [None, None, (capitals_head, TiltSettings()), (capitals_head, TiltSettings())]
    tensors, info = _random_asu(real_lm, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    add_to_llama_cpp(llama, "asu_test", tensors, info, real_lm.model.config)
    try:
        alone = [generate(llama, tok, [p], [s], HeadGuide([r]) if r else None, [n])[0]
                 for p, s, r, n in zip(prompts, params, rows, names)]
        plain = [generate(llama, tok, [p], [s], HeadGuide([r]) if r else None)[0]
                 for p, s, r in zip(prompts, params, rows)]
        batch = Batch(llama, tok, prompts[:3], params[:3], HeadGuide(rows[:3]), names[:3])
        for _ in range(3):
            batch.step()
        kept = list(batch.rows)  # finished rows leave the batch (compact): keep them to read their answers
        joining = Batch(llama, tok, prompts[3:], params[3:], HeadGuide(rows[3:]), names[3:])
        batch.merge(joining)
        kept += joining.rows
        while not batch.done:
            batch.step()
            batch.compact()
        batch.close()
        together = [r.completion() for r in kept]
    finally:
        llama.remove_adapter("asu_test")
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.logprobs == a.logprobs and t.prompt_logprobs == a.prompt_logprobs
    changed = [a.token_ids != p.token_ids for a, p in zip(alone, plain)]
    assert changed[0] and not changed[1] and not changed[3], changed  # the adapter's rows (0, 2) and only those
    assert len(llama.free) == llama.rows and not llama.adapters


def test_a_lookahead_on_llama_cpp_gives_the_logits_feeding_would_and_leaves_the_row_as_it_was(real_lm, llama):
    """`LlamaRows.peek` (the whole-words lookahead) decodes each candidate in the row's own sequence and removes it:
    each result is the logits the row gets when that token is really fed, the row then decodes as it would have,
    and every sequence is free afterwards."""
    from lethe.heads.decoding.decode import Batch, generate
    from lethe.heads.decoding.sampling import SamplingParams

    tok = real_lm.tokenizer
    prompts = _prompts(tok, ["France", "Japan"])
    params = [SamplingParams(max_new_tokens=8, temperature=0)] * 2
    batch = Batch(llama, tok, prompts, params)
    batch.step()
    tokens = torch.tensor(tok(" Paris Lyon the", add_special_tokens=False)["input_ids"])
    ahead = batch.runner.peek([1] * len(tokens), tokens)
    for token, got in zip(tokens.tolist(), ahead):
        fed = Batch(llama, tok, prompts[1:], params[1:])
        fed.step()
        fed.runner.feed(torch.tensor([token]))
        torch.testing.assert_close(got, fed.runner.logits()[0], rtol=1e-4, atol=1e-4)
        fed.close()
    while not batch.done:
        batch.step()
    batch.close()
    for prompt, row in zip(prompts, batch.rows):
        assert row.token_ids == generate(llama, tok, [prompt], params[0])[0].token_ids
    assert sorted(llama.free) == list(range(ROWS))
