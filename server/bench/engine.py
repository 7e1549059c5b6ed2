"""`lethe bench engine`: Lethe's decode speed against what CPU users run today, side by side in one run.

On the same chat prompts, greedy, `new_tokens` new tokens each (end-of-text ignored, the prompt's evaluation
included in every figure):
* transformers' `model.generate` (the reference: float32 eager);
* Lethe's decode loop without a head and with a T3 head, at batch 1 and batch 8, on each backend: torch (the model
  as loaded) and, given `decoder` (`heads.decoding.llamacpp`), the llama.cpp engine on the GGUF file;
* llama.cpp on the model's GGUF file (`gguf`, with llama-cpp-python installed), single stream, in each way this
  build runs (`server.bench.engine_llamacpp`: its defaults, token by token, without CPU-specific layouts), each in a
  process of its own, since some builds crash on batched prompts; and 8 sequences in one batch.
Then the issue-16 ratios against llama.cpp's fastest single stream (of Lethe's fastest backend with a head), and
greedy equality of whole answers (up to end-of-text) over `equality` prompts: Lethe against `model.generate`,
llama.cpp against Lethe's float32, and Lethe's llama.cpp engine against llama.cpp's own answers, against Lethe's
float32, and batched (8 rows) against alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lethe.heads.decoding.decode import eos_ids, generate, generate_chunked
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import T3Head
from lethe.server.bench import shown_path
from lethe.server.bench.t3 import _paired_ratio, _timed_runs, hf_generate

LLAMA_MODES = ("default", "token", "plain", "no-flash-attn")


def llamacpp_run(gguf: Path, prompt_ids: list[list[int]], new_tokens: int, mode: str, batch: int, rounds: int,
                 answers: bool = False, timeout: float = 900) -> dict:
    """One `server.bench.engine_llamacpp` run in a process of its own: its JSON, or {"error": why} if it crashed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_ids, f)
    try:
        proc = subprocess.run([sys.executable, "-m", "lethe.server.bench.engine_llamacpp", str(gguf), f.name,
                               str(new_tokens), mode, str(batch), str(rounds)] + (["answers"] if answers else []),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        reason = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return {"mode": mode, "batch": batch, "error": f"crashed ({reason}) {tail}".strip()}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same(a: list[list[int]], b: list[list[int]]) -> dict:
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    first = [next((j for j, (p, q) in enumerate(zip(a[i], b[i])) if p != q), min(len(a[i]), len(b[i])))
             for i in differ]
    return {"equal": len(a) - len(differ), "of": len(a), "first_difference_at": first}


def bench_engine(lm, head: T3Head, settings: TiltSettings | None, prompts: list[str], new_tokens: int = 64,
                 repeats: int = 3, gguf: Path | None = None, equality: int = 48, log=print, decoder=None,
                 asu: str | None = None) -> dict:
    """`asu`: an ASU adapter loaded into `decoder` (`heads.asu.gguf.add_to_llama_cpp`), timed on every row and on
    half the rows (beside base rows), and its answers compared batched and alone."""
    model, tok = lm.model, lm.tokenizer
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    guide = HeadGuide.uniform(head, settings or TiltSettings())
    threads = torch.get_num_threads()
    result: dict = {"model": shown_path(lm.path), "new_tokens": new_tokens, "torch_threads": threads,
                    "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "lethe": {}}
    for batch in (1, 8):
        chosen = (prompts * batch)[:batch]
        log(f"bench engine: Lethe and model.generate, batch {batch}")
        runs = _timed_runs({"hf_generate": hf_generate(lm, chosen, new_tokens),
                            "lethe": lambda: generate(model, tok, chosen, params),
                            "lethe_t3": lambda: generate(model, tok, chosen, params, guide)}, repeats)
        if decoder is not None:  # timed apart: torch's runs in between slowed it (104 against 120 tokens/s, batch 8)
            log(f"bench engine: Lethe's llama.cpp engine, batch {batch}")
            generate(decoder, tok, chosen, SamplingParams(max_new_tokens=2, temperature=0.0))  # weights paged in
            timed = {"lethe_llamacpp": lambda: generate(decoder, tok, chosen, params),
                     "lethe_llamacpp_t3": lambda: generate(decoder, tok, chosen, params, guide)}
            if asu is not None:
                every, half = [asu] * batch, [asu if i % 2 == 0 else "__base__" for i in range(batch)]
                timed |= {"lethe_llamacpp_asu": lambda: generate(decoder, tok, chosen, params, adapters=every),
                          "lethe_llamacpp_asu_t3": lambda: generate(decoder, tok, chosen, params, guide, every),
                          "lethe_llamacpp_asu_mixed_with_base": lambda: generate(decoder, tok, chosen, params,
                                                                                 adapters=half)}
            runs |= _timed_runs(timed, repeats)
        result["lethe"][f"batch_{batch}"] = {
            **{f"{k}_tokens_per_s": round(batch * new_tokens / statistics.median(v), 1) for k, v in runs.items()},
            "t3_over_no_head": _paired_ratio(runs, "lethe_t3", "lethe"),
            "lethe_speedup_over_hf_generate": _paired_ratio(runs, "hf_generate", "lethe")}
        if decoder is not None:
            for k in ("t3", "asu", "asu_t3", "asu_mixed_with_base"):
                if f"lethe_llamacpp_{k}" in runs:
                    result["lethe"][f"batch_{batch}"][f"llamacpp_{k}_over_no_head"] = _paired_ratio(
                        runs, f"lethe_llamacpp_{k}", "lethe_llamacpp")
    sample = prompts[:equality]
    stop = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    log(f"bench engine: greedy answers to {len(sample)} prompts (Lethe, model.generate)")
    lethe_answers = [c.token_ids for c in generate_chunked(model, tok, sample, stop, batch_size=8)]
    eos = sorted(eos_ids(model, tok))
    hf_answers = []
    for p in sample:  # one at a time: no padding, transformers' own reference path
        enc = tok([p], return_tensors="pt", add_special_tokens=False).to(lm.device)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
        ids = out[0, enc["input_ids"].shape[1]:].tolist()
        hf_answers.append(ids[:next((j for j, t in enumerate(ids) if t in eos), len(ids))])
    result["equality_lethe_vs_hf_generate"] = _same(lethe_answers, hf_answers)
    if gguf is None:
        result["llama_cpp"] = {"skipped": "no --gguf file"}
    else:
        result["llama_cpp"] = _llamacpp(gguf, tok, prompts, sample, new_tokens, repeats, lethe_answers, log)
    if decoder is not None:
        log(f"bench engine: greedy answers to {len(sample)} prompts on Lethe's llama.cpp engine, 8 rows and alone")
        fast = [c.token_ids for c in generate_chunked(decoder, tok, sample, stop, batch_size=8)]
        fast_alone = [c.token_ids for c in generate_chunked(decoder, tok, sample, stop, batch_size=1)]
        result["equality_lethe_llamacpp"] = {"batched_vs_alone": _same(fast, fast_alone),
                                             "vs_lethe_float32": _same(fast, lethe_answers)}
        if asu is not None:
            log(f"bench engine: ASU answers to {len(sample)} prompts on Lethe's llama.cpp engine, 8 rows and alone")
            result["equality_lethe_llamacpp"]["asu_batched_vs_alone"] = _same(*(
                [c.token_ids for c in generate_chunked(decoder, tok, sample, stop, batch_size=n, adapter=asu)]
                for n in (8, 1)))
        for key, name in (("batch_8_no_flash_attn", "vs_llama_cpp"), ("batch_8", "vs_llama_cpp_flash_attn")):
            if "answers" in result["llama_cpp"].get(key, {}):
                result["equality_lethe_llamacpp"][name] = _same(fast, result["llama_cpp"][key]["answers"])
    single = [r["tokens_per_s"] for r in result["llama_cpp"].get("single_stream", []) if "tokens_per_s" in r]
    if single:
        best = max(single)
        key, ratio = ("lethe_llamacpp_t3", "llamacpp_t3_over_no_head") if decoder is not None else ("lethe_t3", "t3_over_no_head")
        b1, b8 = result["lethe"]["batch_1"], result["lethe"]["batch_8"]
        result["llama_cpp_single_stream_best_tokens_per_s"] = best
        result["bars"] = {"backend": key,
                          "batch_1_t3_over_llama_cpp (>= 0.5)": round(b1[f"{key}_tokens_per_s"] / best, 3),
                          "batch_8_t3_over_llama_cpp_single_stream (>= 2)": round(b8[f"{key}_tokens_per_s"] / best, 3),
                          "t3_over_no_head batch 1 / 8 (<= 1.05)": [b1[ratio], b8[ratio]]}
    return result


def _llamacpp(gguf: Path, tok, prompts: list[str], sample: list[str], new_tokens: int, repeats: int,
              lethe_answers: list[list[int]], log) -> dict:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out: dict = {"file": str(gguf), "single_stream": []}
    for mode in LLAMA_MODES:
        log(f"bench engine: llama.cpp, one stream, {mode}")
        out["single_stream"].append({k: v for k, v in llamacpp_run(gguf, ids, new_tokens, mode, 1, repeats).items()
                                     if k != "tokens"})
    # 8 sequences in one batch: its defaults where they ran alone (this build's batched kernels work), else plain
    batch_mode = "default" if "tokens_per_s" in out["single_stream"][0] else "plain"
    log(f"bench engine: llama.cpp, 8 sequences in one batch ({batch_mode}), and its greedy answers")
    sample_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in sample]
    batched = llamacpp_run(gguf, sample_ids, new_tokens, batch_mode, 8, repeats, answers=True)
    out["batch_8"] = {k: v for k, v in batched.items() if k != "tokens"}
    if "answers" in batched:
        out["equality_llama_cpp_vs_lethe_float32"] = _same(batched["answers"], lethe_answers)
    if batch_mode == "default":  # the answers to compare Lethe's llama.cpp engine with: the same attention
        log("bench engine: llama.cpp, 8 sequences in one batch, flash attention off (as Lethe's engine), its answers")
        same_attention = llamacpp_run(gguf, sample_ids, new_tokens, "no-flash-attn", 8, 1, answers=True)
        out["batch_8_no_flash_attn"] = {k: v for k, v in same_attention.items() if k not in ("tokens", "seconds")}
    return out
