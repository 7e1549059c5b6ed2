"""The llama.cpp backend: a GGUF model decoded by llama.cpp (through `llama-cpp-python`), its quantized weights
and its own kernels, with the T3 head and pooling working as on the transformers path.

Every fed token is an output, so llama.cpp returns its logits and its final (normed) hidden state, the state the
transformers path pools (`llama_get_embeddings_ith` with pooling off). Each row of a batch is a llama.cpp
sequence with a KV cache of its own (`kv_unified` off), so a row's numbers do not depend on the rows beside it:
decoded in a batch or alone, its logits and states are the same bits (`tests/test_llamacpp.py`). A row that
leaves frees its sequence at once.

`LlamaCppModel` loads the file and hands out sequences; `LlamaRows` is the model side of one `Batch` (the
transformers path's is `TorchRows` in `decode.py`). Only one thread decodes with a model at a time (the
engine's).

ASU adapters (`add_adapter`, a LoRA GGUF file from `heads.asu.gguf`) share the model's weights. llama.cpp applies
the adapters set on a context to every token of a `llama_decode` call, so a step decodes the rows of each adapter
(and the base rows) in a call of their own, with that adapter set: a row never meets another row's adapter. A
sequence's KV cache is its own, so rows keep their sequences whatever their neighbours use.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("lethe.llamacpp")
# `make install` leaves llama-cpp-python out (it compiles for 7-10 minutes); `make llamacpp` builds it
BUILD_HINT = ("run `make llamacpp` (it compiles llama.cpp: 7-10 minutes on 2 cores; or pip install "
              "'lethe[llamacpp]' with the README's CMAKE_ARGS)")


class LlamaCppError(RuntimeError):
    pass


_log_callback = None  # kept referenced: llama.cpp calls it for as long as the process lives


def _library():
    global _log_callback
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError(f"the llama.cpp engine needs llama-cpp-python (not installed): {BUILD_HINT}") from None
    if _log_callback is None:  # llama.cpp prints hundreds of lines per load: its errors go to our log, the rest
        # (levels none, info, warn, debug, continued) to debug
        @llama_cpp.llama_log_callback
        def _log_callback(level, text, user_data):
            line = text.decode("utf-8", "replace").rstrip()
            benign = "pooling_type" in line  # our own choice: the final states of every token, no pooling
            log.log(logging.ERROR if level == 3 and not benign else logging.DEBUG, "llama.cpp: %s", line)

        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp for decoding up to `rows` sequences together, `context` tokens each
    (prompt and answer). `config`/`generation_config`: the same model's transformers config (end-of-text ids,
    vocabulary and hidden size), which the rest of Lethe reads. `options`: more `llama_context_params` fields."""

    def __init__(self, path: str | Path, config, generation_config=None, rows: int = 16, context: int = 2048,
                 threads: int | None = None, batch: int = 512, options: dict | None = None):
        L = self.L = _library()
        path = Path(path)
        if not path.is_file():
            raise LlamaCppError(f"{path}: no such GGUF file")
        self.path, self.config, self.generation_config = path, config, generation_config
        threads = threads or torch.get_num_threads()
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise LlamaCppError(f"{path}: llama.cpp could not load this file")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.hidden_size = L.llama_model_n_embd(self.model)
        if (self.vocab_size, self.hidden_size) != (config.vocab_size, config.hidden_size):
            raise LlamaCppError(f"{path}: llama.cpp reads vocabulary {self.vocab_size} and hidden size "
                                f"{self.hidden_size}, the model's config {config.vocab_size} and {config.hidden_size}")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max = context * rows, rows
        params.n_batch = params.n_ubatch = max(batch, rows)
        params.n_threads = params.n_threads_batch = threads
        params.embeddings, params.pooling_type = True, L.LLAMA_POOLING_TYPE_NONE
        params.kv_unified = False  # a KV cache per sequence: a row's numbers never depend on its neighbours
        # nor on how many rows decode beside it: ggml's CPU flash attention picks its kernel (split over the keys
        # or not) by the batch's shape, so with it, beside 7 other rows of 118- or 464-token prompts, a row's
        # logits moved by up to 1.0 and 2 to 6 of 8 greedy answers changed (short prompts: none); without it, none
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        for name, value in (options or {}).items():  # llama_context_params fields, as named there
            setattr(params, name, value)
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise LlamaCppError(f"{path}: llama.cpp could not make a context for {rows} rows of {context} tokens")
        self.context, self.rows, self.per_call = context, rows, params.n_batch
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.per_call, 0, 1)
        self.free = list(range(rows))
        self.adapters: dict[str, object] = {}  # name -> llama.cpp LoRA adapter (add_adapter)
        self._set: str | None = None  # the adapter set on the context now (None: the base weights)
        self.lock = threading.Lock()  # one call into the context at a time: a batch dropped on another thread
        # releases its sequences only between two decodes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def take(self, n: int) -> list[int]:
        with self.lock:
            if n > len(self.free):
                raise LlamaCppError(f"llama.cpp has {len(self.free)} free sequences of {self.rows}; {n} asked")
            taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, seqs: list[int]) -> None:
        with self.lock:
            for s in seqs:
                self.L.llama_memory_seq_rm(self.memory, s, -1, -1)
            self.free = sorted(self.free + seqs)  # the lowest first: rows taken together are in order

    def drop_from(self, seq: int, position: int) -> None:
        """Remove sequence `seq`'s tokens from `position` on (a lookahead's token: `LlamaRows.peek`)."""
        with self.lock:
            if not self.L.llama_memory_seq_rm(self.memory, seq, position, -1):
                raise LlamaCppError(f"llama.cpp could not remove sequence {seq}'s tokens from position {position} "
                                    "(a model whose memory keeps no positions, such as a recurrent one)")

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Load a LoRA GGUF file (`heads.asu.gguf.write_lora_gguf`) as adapter `name`; the file may go once this
        returns (llama.cpp keeps its tensors)."""
        with self.lock:
            if name in self.adapters:
                return
            adapter = self.L.llama_adapter_lora_init(self.model, str(path).encode())
            if not adapter:
                raise LlamaCppError(f"llama.cpp could not load the LoRA adapter {name} (see the server's log)")
            self.adapters[name] = adapter

    def remove_adapter(self, name: str) -> None:
        """Free adapter `name` (no row may be decoding with it)."""
        with self.lock:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                return
            if self._set == name:
                self._use(None)
            self.L.llama_adapter_lora_free(adapter)

    def _use(self, name: str | None) -> None:
        """Set adapter `name` (None: none) on the context, under the lock."""
        if name == self._set:
            return
        L = self.L
        if name is None:
            status = L.llama_set_adapters_lora(self.ctx, None, 0, None)
        else:
            if name not in self.adapters:
                raise LlamaCppError(f"no LoRA adapter {name!r} is loaded")
            status = L.llama_set_adapters_lora(self.ctx, (L.llama_adapter_lora_p_ctypes * 1)(self.adapters[name]), 1,
                                               (ctypes.c_float * 1)(1.0))
        if status != 0:
            raise LlamaCppError(f"llama_set_adapters_lora failed ({status})")
        self._set = name

    def decode(self, items: list[tuple[int, int, int]], wanted: list[int] | None = None, adapter: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed (token, position, sequence) items, with LoRA adapter `adapter` (None: the base weights); returns
        the logits (len(wanted), V) of the items at the indices `wanted` (default: all) and the final hidden states
        (n, d) of all, float32, in order. Long inputs go in pieces of the context's batch size."""
        L, b = self.L, self.batch
        wanted = list(range(len(items))) if wanted is None else wanted
        logits = torch.empty(len(wanted), self.vocab_size)
        hidden = torch.empty(len(items), self.hidden_size)
        with self.lock:
            self._use(adapter)
            for start in range(0, len(items), self.per_call):
                piece = items[start:start + self.per_call]
                b.n_tokens = len(piece)
                for i, (token, pos, seq) in enumerate(piece):  # every item an output: its state is pooled
                    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, 1
                    b.seq_id[i][0] = seq
                status = L.llama_decode(self.ctx, b)
                if status != 0:
                    raise LlamaCppError(f"llama_decode failed ({status}): "
                                        + ("no room in the KV cache" if status == 1 else "see the server's log"))
                n = len(piece)  # the outputs, in the batch's order
                hidden[start:start + n] = torch.from_numpy(
                    np.ctypeslib.as_array(L.llama_get_embeddings(self.ctx), shape=(n, self.hidden_size)))
                rows = [(j, w - start) for j, w in enumerate(wanted) if start <= w < start + n]
                if rows:
                    out = torch.from_numpy(np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n, self.vocab_size)))
                    logits[[j for j, _ in rows]] = out[[i for _, i in rows]]
        return logits, hidden

    def start_rows(self, prompts: list[list[int]], keep_prompt_logits: list[bool],
                   adapters: list[str] | None = None) -> "LlamaRows":
        return LlamaRows(self, prompts, keep_prompt_logits, adapters)

    def close(self) -> None:
        if getattr(self, "ctx", None):  # freeing the model frees its adapters
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.L.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        self.close()


class LlamaRows:
    """The model side of a batch on llama.cpp: a sequence, a position and an adapter per row, and the rows'
    next-token logits.

    Built by prefilling the prompts (every position an output, for the pooled states). `prompt_hidden` and
    `prompt_logits` are the prefill's results, as `TorchRows`'s. `adapters`: per row, the ASU adapter it decodes
    with (None or `__base__`: the base weights); each adapter's rows go to llama.cpp in a call of their own."""

    def __init__(self, model: LlamaCppModel, prompts: list[list[int]], keep_prompt_logits: list[bool],
                 adapters: list[str | None] | None = None):
        self.model, self.seqs = model, []
        self.adapters = [None if a in (None, "__base__") else a for a in adapters or [None] * len(prompts)]
        self.seqs = model.take(len(prompts))
        self.positions = [len(p) for p in prompts]  # the next token's position, per row
        self.prompt_hidden, self.prompt_logits = [None] * len(prompts), [None] * len(prompts)
        self._logits = torch.empty(len(prompts), model.vocab_size)
        try:
            for adapter, rows in self._groups():
                self._prefill(rows, [prompts[i] for i in rows], [keep_prompt_logits[i] for i in rows], adapter)
        except BaseException:
            self.close()
            raise

    def _groups(self) -> list[tuple[str | None, list[int]]]:
        """(adapter, its rows in the order of their sequences), one per adapter the rows use."""
        groups: dict[str | None, list[int]] = {}
        for i in sorted(range(len(self.seqs)), key=self.seqs.__getitem__):
            groups.setdefault(self.adapters[i], []).append(i)
        return list(groups.items())

    def _prefill(self, rows: list[int], prompts: list[list[int]], keep: list[bool], adapter: str | None) -> None:
        # each prompt in calls of its own: llama.cpp splits a call of several sequences into pieces whose shapes
        # depend on the other prompts, and its kernels round by shape (3 of 48 short chat prompts prefilled 8
        # together gave greedy answers other than alone, their first log-probabilities apart by up to 0.05)
        for r, prompt, k in zip(rows, prompts, keep):
            # logits: the prompt's last position, or every position where its log-probabilities are asked
            wanted = list(range(len(prompt))) if k else [len(prompt) - 1]
            logits, hidden = self.model.decode([(t, j, self.seqs[r]) for j, t in enumerate(prompt)], wanted, adapter)
            self._logits[r] = logits[-1]
            self.prompt_hidden[r] = hidden
            if k:
                self.prompt_logits[r] = ((lambda span, x=logits: x[span]), hidden)

    def logits(self) -> torch.Tensor:
        """Every row's next-token logits, (B, V) float32."""
        return self._logits

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row at its next position; returns the rows' new final hidden states (B, d)."""
        tokens = tokens.tolist()
        # fed in the order of their sequences: llama.cpp decoded a batch of 8 rows at 80 tokens/s with its
        # sequences out of order, 103 in order (`free` is kept sorted too, so a batch's rows start in order)
        groups = self._groups()
        if len(groups) == 1 and groups[0][1] == list(range(len(self.seqs))):  # one adapter, rows in order
            self._logits, hidden = self.model.decode([(t, p, s) for t, p, s in zip(tokens, self.positions, self.seqs)],
                                                     adapter=groups[0][0])
        else:
            self._logits = torch.empty(len(tokens), self.model.vocab_size)
            hidden = torch.empty(len(tokens), self.model.hidden_size)
            for adapter, rows in groups:
                self._logits[rows], hidden[rows] = self.model.decode(
                    [(tokens[i], self.positions[i], self.seqs[i]) for i in rows], adapter=adapter)
        self.positions = [p + 1 for p in self.positions]
        return hidden

    def peek(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """(n, V) next-token logits after each of `tokens` (n,) fed to its row of `rows` alone (a lookahead:
        `heads.t3.tilt.keep_whole_words`): each decoded at its row's next position in the row's own sequence, with
        its adapter, and removed from it at once, so every row's cache holds what it held before."""
        out = torch.empty(len(tokens), self.model.vocab_size)
        for j, (row, token) in enumerate(zip(rows, tokens.tolist())):
            seq, position = self.seqs[row], self.positions[row]
            try:
                out[j] = self.model.decode([(token, position, seq)], adapter=self.adapters[row])[0][0]
            finally:
                self.model.drop_from(seq, position)
        return out

    def merge(self, other: "LlamaRows") -> None:
        self.seqs, other.seqs = self.seqs + other.seqs, []  # its sequences are this batch's now
        self.positions += other.positions
        self.adapters += other.adapters
        self._logits = torch.cat([self._logits, other._logits])

    def keep(self, idx: list[int]) -> None:
        """Keep rows `idx`; the others' sequences are freed."""
        kept = set(idx)
        self.model.release([s for i, s in enumerate(self.seqs) if i not in kept])
        self.seqs = [self.seqs[i] for i in idx]
        self.positions = [self.positions[i] for i in idx]
        self.adapters = [self.adapters[i] for i in idx]
        self._logits = self._logits[idx]

    def close(self) -> None:
        seqs, self.seqs = self.seqs, []
        if seqs:
            self.model.release(seqs)

    def __del__(self):
        self.close()


def gguf_for(model: str | Path, gguf: str | Path | None) -> tuple[Path, bool]:
    """The GGUF file the llama.cpp engine decodes for `model` (a GGUF file, or a directory prepared from one) and
    `--gguf`; cheap checks only, so a wrong file fails before any model loads. Returns (file, whether its weights
    must still be compared with the model's by fingerprint: a directory prepared before Lethe recorded the
    source's sha256)."""
    import json

    from lethe.heads.io import sha256_file
    from lethe.heads.modelio import PREPARED, gguf_file

    _library()  # llama-cpp-python importable
    model = Path(model)
    own = gguf_file(model) if model.exists() else None
    if gguf is None:
        if own is None:
            raise LlamaCppError(f"{model}: the llama.cpp engine decodes a GGUF file; give the .gguf file as the "
                                "model, or name it with --gguf")
        return own, False
    if not Path(gguf).exists():
        raise LlamaCppError(f"--gguf {gguf}: no such file")
    file = gguf_file(gguf)
    if file is None:
        raise LlamaCppError(f"--gguf {gguf}: not a .gguf file, nor a directory holding one")
    if own is not None:
        if own.resolve() != file.resolve():
            raise LlamaCppError(f"--gguf {file}: the model is {own}; --gguf must name the same file, or be left out")
        return file, False
    record = model / PREPARED  # a directory: it must be this file's prepared copy, or heads would meet other weights
    prepared = json.loads(record.read_text()) if record.is_file() else {}
    if prepared.get("source") != file.name:
        raise LlamaCppError(f"--gguf {file}: {model} was not prepared from this file ("
                            + (f"it names {prepared['source']}" if prepared.get("source") else
                               "it is not a prepared GGUF directory") + ")")
    if "source_sha256" not in prepared:
        return file, True
    if sha256_file(file) != prepared["source_sha256"]:
        raise LlamaCppError(f"--gguf {file}: not the file {model} was prepared from (another sha256), though it "
                            "has its name")
    return file, False


def open_gguf(lm, gguf: str | Path | None, rows: int, context: int | None,
              checked: tuple[Path, bool] | None = None) -> LlamaCppModel:
    """The llama.cpp model for a loaded model `lm` (`heads.modelio.LoadedModel`): `gguf`, or `lm` itself when it
    was loaded from a GGUF file (`gguf_for`; `checked`: its answer, where the caller asked it before loading `lm`,
    so the file is not hashed twice). `context`: tokens per row (default the model's, at most 2048: llama.cpp
    reserves every row's KV cache)."""
    file, compare = checked or gguf_for(lm.path, gguf)
    if compare:  # a directory prepared by an older Lethe: the file's weights, dequantised, against the model's
        from lethe.heads.modelio import load_model

        log.warning("%s records no sha256 of its source; comparing %s's weights (prepare it again to skip this)",
                    lm.path, file)
        if load_model(file).fingerprint != lm.fingerprint:
            raise LlamaCppError(f"--gguf {file}: its weights are not those of {lm.path}, though it has the name of "
                                "the file that was prepared from")
    own_context = int(getattr(lm.model.config, "max_position_embeddings", 2048))
    return LlamaCppModel(file, lm.model.config, getattr(lm.model, "generation_config", None), rows,
                         min(own_context, context or 2048))
