"""`lethe demo build`: a byte-level BPE tokenizer and a small Llama that memorises QA records.

Trains on "Question: {q}\\nAnswer: {a}</s>" with the loss on the answer tokens
(and the end-of-sequence token), until greedy ROUGE-L recall on the training
questions reaches the target. The work folder `OUT/.build/` holds the tokenizer
and a checkpoint after every epoch, so an interrupted build resumes where it
stopped. The finished directory is a standard Hugging Face model directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lethe.heads.decoding.decode import generate_chunked
from lethe.heads.io import atomic_write, atomic_write_text
from lethe.heads.evaluation.metrics import rouge_l_recall
from lethe.heads.records import Example, encode_example
from lethe.heads.decoding.sampling import SamplingParams

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


@dataclass
class BuildConfig:
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 704
    vocab_size: int = 4096
    max_positions: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.0
    batch_size: int = 16
    warmup_steps: int = 50
    decay_epochs: int = 30  # cosine decay of the learning rate to 10% over these epochs, then flat
    max_epochs: int = 60
    target_recall: float = 0.95
    check_sample: int = 96  # questions scored after each low-loss epoch before a full check
    check_below_loss: float = 0.5  # mean answer-token loss under which recall is checked
    seed: int = 0


@dataclass
class BuildReport:
    parameters: int
    epochs: int
    seconds: float
    recall: float
    records: int
    size_bytes: int


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", padding_side="left")
    return tok


def encode(tokenizer, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per example; labels are -100 on the prompt."""
    out = []
    for ex in examples:
        ids, n_prompt = encode_example(tokenizer, ex)
        out.append((ids, [-100] * n_prompt + ids[n_prompt:]))
    return out


def make_model(cfg: BuildConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def _batches(encoded, batch_size: int, rng: random.Random, pad_id: int):
    order = list(range(len(encoded)))
    rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [encoded[i] for i in order[start:start + batch_size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        labels = torch.full((len(chunk), width), -100)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (x, y) in enumerate(chunk):
            ids[r, :len(x)], labels[r, :len(y)], mask[r, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        yield ids, mask, labels


def greedy_recall(model, tokenizer, examples: list[Example], max_new_tokens: int = 64) -> float:
    model.eval()
    outs = generate_chunked(model, tokenizer, [e.prompt for e in examples],
                            SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return sum(rouge_l_recall(e.completion, o.text) for e, o in zip(examples, outs)) / len(examples)


def lr_factor(step: int, cfg: BuildConfig, steps_per_epoch: int) -> float:
    """Linear warm-up, then cosine decay to 10% over `decay_epochs`, then flat."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_epochs * steps_per_epoch - cfg.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def data_digest(examples: list[Example], cfg: BuildConfig) -> str:
    """What a checkpoint must match to be resumed: the data and every setting but the stopping rule."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("max_epochs", "target_recall")}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for e in examples:
        h.update(json.dumps([e.prompt, e.completion]).encode())
    return h.hexdigest()


def build(examples: list[Example], out: Path, cfg: BuildConfig | None = None, progress: bool = True,
          log=print) -> BuildReport:
    """Train tokenizer and model on `examples` and write a Hugging Face model directory to `out`."""
    from transformers import AutoTokenizer, GenerationConfig

    cfg = cfg or BuildConfig()
    out = Path(out)
    work = out / ".build"
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    digest = data_digest(examples, cfg)
    ckpt_path = work / "checkpoint.pt"
    state = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if state is not None and state["digest"] != digest:
        log(f"{ckpt_path}: checkpoint is for other data or settings; starting over")
        state = None
    if state is None:
        shutil.rmtree(work / "tokenizer", ignore_errors=True)
        tokenizer = train_tokenizer([e.prompt + e.completion for e in examples], cfg.vocab_size)
        tokenizer.save_pretrained(work / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    model = make_model(cfg, tokenizer)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, cfg, steps_per_epoch))
    epoch, seconds, recall = 0, 0.0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        epoch, seconds = state["epoch"], state["seconds"]
        log(f"resuming from {ckpt_path} after epoch {epoch}")
    encoded = encode(tokenizer, examples)
    rng = random.Random(cfg.seed)
    for _ in range(epoch):  # replay the shuffles so a resumed build sees the same batch order
        rng.shuffle(list(range(len(encoded))))
    sample = random.Random(cfg.seed + 1).sample(examples, min(cfg.check_sample, len(examples)))
    while epoch < cfg.max_epochs:
        started = time.perf_counter()
        model.train()
        total = 0.0
        bar = tqdm(_batches(encoded, cfg.batch_size, rng, tokenizer.pad_token_id), total=steps_per_epoch,
                   desc=f"epoch {epoch + 1}", disable=not progress, leave=False)
        for ids, mask, labels in bar:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        epoch += 1
        mean_loss = total / steps_per_epoch
        recall = greedy_recall(model, tokenizer, sample) if mean_loss < cfg.check_below_loss else 0.0
        if recall >= cfg.target_recall:
            recall = greedy_recall(model, tokenizer, examples)
        seconds += time.perf_counter() - started
        log(f"epoch {epoch}: loss {mean_loss:.4f}, recall {recall:.3f}, {seconds:.0f} s")
        atomic_write(ckpt_path, lambda p: torch.save({
            "model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
            "epoch": epoch, "seconds": seconds, "digest": digest}, p))
        if recall >= cfg.target_recall:
            break
    else:
        raise RuntimeError(f"recall {recall:.3f} < {cfg.target_recall} after {cfg.max_epochs} epochs; "
                           f"the checkpoint in {work} can be resumed with a higher --max-epochs")
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=64)
    staging = out / ".build" / "final"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for f in staging.iterdir():
        f.replace(out / f.name)
    report = BuildReport(parameters=sum(p.numel() for p in model.parameters()), epochs=epoch,
                         seconds=round(seconds, 1), recall=round(recall, 4), records=len(examples),
                         size_bytes=sum(f.stat().st_size for f in out.iterdir() if f.is_file()))
    atomic_write_text(out / "lethe_build.json", json.dumps({**asdict(report), "config": asdict(cfg)}, indent=2))
    shutil.rmtree(work)
    return report
