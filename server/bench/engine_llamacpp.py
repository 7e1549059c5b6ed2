"""llama.cpp on a GGUF file, through llama-cpp-python's low-level API, for `lethe bench engine`: greedy decoding of
several sequences in one batch, timed, in a process of its own (a llama.cpp build that crashes must not take the
bench down with it).

    python -m lethe.server.bench.engine_llamacpp FILE.gguf PROMPTS.json NEW_TOKENS MODE BATCH ROUNDS [answers]

PROMPTS.json holds token-id lists. MODE is one of
    default      llama.cpp's own defaults, as a llama.cpp user runs it: the prompt in batches of 512 tokens, and its
                 CPU-specific weight layouts (`use_extra_bufts`: AMX or repacked kernels where the build has them)
    token        the same weights, every token (the prompt's too) fed alone: builds whose batched kernels crash
    plain        no CPU-specific layouts (`use_extra_bufts` off): batches work in every build, at some speed cost
    no-flash-attn  the defaults with flash attention off, as Lethe's llama.cpp engine runs (its CPU kernel depends
                 on the batch's shape, so a row's answer would depend on the rows beside it)
It prints one JSON object: tokens/s over the best of ROUNDS runs (the prompt's evaluation included, as in Lethe's
figures), the tokens of the first BATCH prompts (greedy, NEW_TOKENS each, end-of-text ignored) and, with `answers`,
every prompt's greedy answer up to end-of-text (8 at a time), for comparing answers.
"""

from __future__ import annotations

import json
import sys
import time


class LlamaCpp:
    def __init__(self, path: str, mode: str = "default", sequences: int = 8, threads: int = 2, n_ctx: int = 4096):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.use_extra_bufts = mode != "plain"
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        batch = 1 if mode == "token" else 512
        sequences = 1 if mode == "token" else sequences  # llama.cpp asserts n_ubatch >= n_seq_max
        ctx = L.llama_context_default_params()
        ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, ctx.n_seq_max = n_ctx, batch, batch, sequences
        ctx.n_threads = ctx.n_threads_batch = threads
        if mode == "no-flash-attn":
            ctx.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(self.model, ctx)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.per_call = batch
        self.batch = L.llama_batch_init(max(batch, sequences), 0, sequences)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """Feed (token, position, sequence, wants output) items; the argmax token of each output, in order."""
        import numpy as np

        b, L = self.batch, self.L
        b.n_tokens = len(items)
        for i, (token, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, int(out)
            b.seq_id[i][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i, item in enumerate(items) if item[3]]

    def greedy(self, prompts: list[list[int]], new_tokens: int, stop_at_eos: bool = False) -> list[list[int]]:
        """Every prompt as a sequence of its own, decoded together, `new_tokens` each (fewer if stopped)."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        following: list[int] = []
        for start in range(0, len(items), self.per_call):
            following += self._decode(items[start:start + self.per_call])
        out: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        while live:
            for s, token in zip(list(live), following):
                if stop_at_eos and L.llama_vocab_is_eog(self.vocab, token):
                    live.remove(s)
                else:
                    out[s].append(token)
            live = [s for s in live if len(out[s]) < new_tokens]
            if live:
                following = self._decode([(out[s][-1], len(prompts[s]) + len(out[s]) - 1, s, True) for s in live])
        return out


def main(argv: list[str]) -> int:
    path, prompts_file, new_tokens, mode, batch, rounds = argv[:6]
    prompts = json.loads(open(prompts_file).read())
    engine = LlamaCpp(path, mode, sequences=max(8, int(batch)))
    chosen = prompts[:int(batch)]
    engine.greedy(chosen, 4)  # warm-up
    best = float("inf")
    for _ in range(int(rounds)):
        started = time.perf_counter()
        tokens = engine.greedy(chosen, int(new_tokens))
        best = min(best, time.perf_counter() - started)
    result = {"mode": mode, "batch": int(batch), "tokens_per_s": round(int(batch) * int(new_tokens) / best, 1),
              "seconds": round(best, 4), "tokens": tokens}
    if argv[6:] == ["answers"]:
        result["answers"] = [a for i in range(0, len(prompts), 8)
                             for a in engine.greedy(prompts[i:i + 8], int(new_tokens), stop_at_eos=True)]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
