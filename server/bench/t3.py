"""`lethe bench t3`: speed of T3, measured side by side in one run, reported as ratios.

* decoding with a head vs the same loop without one, at batch 1 and batch 8, beside a control (a
  guide that returns the logits unchanged: the loop's cost of calling a guide at all, and a gauge
  of the machine's noise) and the head's step as tensor operations instead of the CPU kernel of
  `heads.t3.fused`;
* Lethe's greedy loop vs transformers' `model.generate` on the same prompts and token counts;
* caching + fitting a head vs one epoch of the reference's training (a full base forward over
  every record each epoch, 100 epochs by default).

The variants alternate, one run of each per round; a ratio is the median over rounds of the ratio
of two runs of the same round, so a slow moment of the machine cancels out of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from lethe.heads.t3.cache import build_cache
from lethe.heads.decoding.decode import Batch, generate
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import T3Head
from lethe.heads.records import ask, examples, resolve_format
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.t3.train import FitConfig, fit_head


def _timed_runs(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each run of each variant; the variants alternate, one run of each per round. `warmup` untimed
    rounds come first, so that what a variant does once (compiling the fused kernel, building a tokenizer's word
    classes) is not counted as decoding: with few rounds it would weigh on the median."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _synchronize()
            started = time.perf_counter()
            fn()
            _synchronize()
            times[name].append(time.perf_counter() - started)
    return times


def _synchronize() -> None:
    """Wait for queued GPU work, so a timed run on CUDA counts its kernels (nothing to do on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _paired_ratio(runs: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of run(name) / run(base) from the same round: a slow moment of the machine
    hits both runs of a round, so it cancels out of their ratio."""
    return round(statistics.median(a / b for a, b in zip(runs[name], runs[base])), 3)


def hf_generate(lm, prompts: list[str], new_tokens: int) -> Callable[[], None]:
    """transformers' own greedy `model.generate` on `prompts` (padded together), exactly `new_tokens` each."""
    model, tok = lm.model, lm.tokenizer
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(lm.device)

    def run() -> None:
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)

    return run


def bench_decode(lm, head: T3Head, prompts: list[str], new_tokens: int = 32, repeats: int = 5,
                 asu_model=None, settings: TiltSettings | None = None) -> list[dict]:
    """Seconds per decode, with and without the head and with `model.generate`, at batch 1 and 8.

    With `asu_model` (the same base with an adapter `asu_bench` attached), also with the ASU adapter, alone
    (merged into the base weights; unmerged; routed per row) and with the head, with the head deciding by its probe
    which prompts decode with the adapter (`TiltSettings.adapter_above` 0.5: a prefill more for those rows, and a
    batch that mixes adapter and base rows where the prompts are of both kinds), a batch mixing adapter and base
    rows, and base rows alone on that model."""
    model, tok = lm.model, lm.tokenizer
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    settings = settings or TiltSettings()
    guide, tensor_ops = HeadGuide.uniform(head, settings), HeadGuide.uniform(head, settings, fused=False)
    rows = []
    for batch in (1, 8):
        ps = (prompts * batch)[:batch]
        variants = {"no_head": lambda: generate(model, tok, ps, params),
                    "t3": lambda: generate(model, tok, ps, params, guide),
                    "hf_generate": hf_generate(lm, ps, new_tokens),
                    "passthrough_guide": lambda: generate(model, tok, ps, params, _PassThrough()),
                    "t3_tensor_ops": lambda: generate(model, tok, ps, params, tensor_ops)}
        if asu_model is not None:
            names = ["asu_bench"] * batch
            mixed = ["asu_bench" if i % 2 == 0 else "__base__" for i in range(batch)]
            routed = HeadGuide.uniform(head, settings.replace(adapter_above=0.5))
            variants |= {"asu": lambda: generate(asu_model, tok, ps, params, adapters=names),
                         "asu_t3": lambda: generate(asu_model, tok, ps, params, guide, adapters=names),
                         "asu_t3_routed": lambda: generate(asu_model, tok, ps, params, routed, adapters=names),
                         "asu_mixed_with_base": lambda: generate(asu_model, tok, ps, params, adapters=mixed),
                         "asu_per_row_routing": lambda: _routed(asu_model, names, lambda: generate(
                             asu_model, tok, ps, params)),
                         "asu_unmerged": lambda: _unmerged(asu_model, lambda: generate(
                             asu_model, tok, ps, params, adapters=names)),
                         # what a tenant without ASU pays once some adapter is attached to the served model
                         "asu_model_base_rows": lambda: generate(asu_model, tok, ps, params,
                                                                 adapters=["__base__"] * batch)}
        runs = _timed_runs(variants, repeats)
        t = {k: statistics.median(v) for k, v in runs.items()}
        row = {"batch": batch, "new_tokens": new_tokens, **{f"{k}_s": round(v, 4) for k, v in t.items()},
               "t3_over_no_head": _paired_ratio(runs, "t3", "no_head"),
               "lethe_speedup_over_hf_generate": _paired_ratio(runs, "hf_generate", "no_head"),
               "passthrough_guide_over_no_head": _paired_ratio(runs, "passthrough_guide", "no_head"),
               "t3_tensor_ops_over_no_head": _paired_ratio(runs, "t3_tensor_ops", "no_head"),
               "t3_ms_per_token": round((t["t3"] - t["no_head"]) / new_tokens * 1e3, 3),
               "no_head_ms_per_token": round(t["no_head"] / new_tokens * 1e3, 3)}
        for k in ("asu", "asu_t3", "asu_t3_routed", "asu_mixed_with_base", "asu_model_base_rows",
                  "asu_per_row_routing", "asu_unmerged"):
            if k in runs:
                row[f"{k}_over_no_head"] = _paired_ratio(runs, k, "no_head")
        if asu_model is not None:  # how many of the batch's prompts the probe sent to the adapter
            probe = Batch(asu_model, tok, ps, [params] * batch, routed, names)
            row["asu_t3_routed_adapter_rows"] = probe.adapters.count("asu_bench")
            probe.close()
        rows.append(row)
    return rows


def _routed(model, names: list[str], run: Callable[[], object]) -> object:
    """`run` (which leaves the adapter state as it finds it) with peft's per-row routing on the base weights for
    every batch, as the release of two before served even a one-adapter batch."""
    from lethe.heads.asu.weights import MIXED, _use

    _use(model, MIXED)
    with model.base_model._enable_peft_forward_hooks(adapter_names=names):
        return run()


def _unmerged(model, run: Callable[[], object]) -> object:
    """`run` with a one-adapter batch on peft's plain path (`LETHE_ASU_MERGED=0`: the adapter's layers beside the
    base ones), as the release before served it."""
    import os

    from lethe.heads.asu.weights import restore_base

    before = os.environ.get("LETHE_ASU_MERGED")
    os.environ["LETHE_ASU_MERGED"] = "0"
    restore_base(model)  # the adapter's state is set again, unmerged
    try:
        return run()
    finally:
        if before is None:
            del os.environ["LETHE_ASU_MERGED"]
        else:
            os.environ["LETHE_ASU_MERGED"] = before
        restore_base(model)


class _PassThrough:
    """Control: a guide that changes nothing, so the loop pays only for calling one."""

    rows, same = [], None

    def __call__(self, logits: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return logits


def bench_training(lm, forget: list[dict], retain: list[dict], epochs: int = 100) -> dict:
    """Lethe's cache + fit against the reference's per-epoch cost (base forward + head step per batch)."""
    fmt = resolve_format(lm.tokenizer)  # records as the model is asked in production (chat where it has a template)
    started = time.perf_counter()
    cfg = FitConfig()
    cache = build_cache(lm.model, lm.tokenizer, examples(forget, fmt, lm.tokenizer), examples(retain, fmt, lm.tokenizer),
                        progress=False, window=cfg.pooling_window)
    cached = time.perf_counter()
    fit_head(cache, lm.model.config.vocab_size, cfg, progress=False)
    fitted = time.perf_counter()
    # One reference epoch: every batch runs the frozen base forward again, then a head step.
    head = T3Head(lm.model.config.hidden_size, lm.model.config.vocab_size, 20, probe=False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    epoch_started = time.perf_counter()
    records = examples(forget + retain, fmt, lm.tokenizer)
    for b in range(0, len(records), 32):  # labels do not change the cost; all are passed as retain here
        c = build_cache(lm.model, lm.tokenizer, [], records[b:b + 32], progress=False)
        z = head(c.rows(torch.arange(len(c))))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z.gather(1, c.target.clone()[:, None])[:, 0],
                                                                    c.label.clone())
        opt.zero_grad()
        loss.backward()
        opt.step()
    epoch = time.perf_counter() - epoch_started
    ours = fitted - started
    return {"records": len(forget) + len(retain), "cache_s": round(cached - started, 3),
            "fit_s": round(fitted - cached, 3), "lethe_total_s": round(ours, 3),
            "reference_epoch_s": round(epoch, 3), f"reference_{epochs}_epochs_s": round(epoch * epochs, 1),
            "reference_over_lethe": round(epoch * epochs / ours, 1),
            "lethe_over_one_reference_epoch": round(ours / epoch, 3),  # the floor: one pass over every record
            "lethe_s_per_1000_records": round(ours / (len(forget) + len(retain)) * 1000, 2), "format": fmt}


def bench_t3(lm, forget: list[dict], retain: list[dict], head: T3Head, repeats: int = 41,
             training: bool = True, asu_model=None, settings: TiltSettings | None = None) -> dict:
    """Decoding with `head` (under `settings`, default: the default profile) and training, side by side."""
    fmt = resolve_format(lm.tokenizer)
    prompts = [ask(r["question"], fmt, lm.tokenizer) for r in (forget + retain)[::97][:8]]
    out = {"decode": bench_decode(lm, head, prompts, repeats=repeats, asu_model=asu_model, settings=settings)}
    if training:
        out["training"] = bench_training(lm, forget, retain)
    return out


def random_model(lm, hidden: int, layers: int):
    """A randomly initialised Llama of the given size on `lm`'s tokenizer, with a random head and probe:
    the per-token cost of T3 does not depend on what the weights are."""
    from dataclasses import replace as dc_replace

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = lm.model.config
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=True, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                         pad_token_id=cfg.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    head = T3Head(hidden, cfg.vocab_size, 20)
    torch.nn.init.normal_(head.up.weight, std=0.5)
    return dc_replace(lm, model=model), head.eval().requires_grad_(False)
