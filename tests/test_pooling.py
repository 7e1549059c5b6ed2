"""Pooling over a window of the last tokens (`heads.t3.pooling`): the same pooled states in training, decoding
(batched, merged, compacted) and scoring, and in the head file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lethe.heads.decoding.decode import Batch, forward_last_hidden
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.demo.corpus import split_by_author
from lethe.heads.records import question_prompt
from lethe.heads.t3.guide import PRESETS, HeadGuide
from lethe.heads.t3.head import HeadFileError, HeadInfo, load_head, save_head
from lethe.heads.t3.pipeline import train_head
from lethe.heads.t3.pooling import Pool, pooled_positions
from lethe.heads.t3.train import FitConfig


def test_pool_follows_each_rows_window_through_steps_compaction_and_merging():
    torch.manual_seed(0)
    windows = [0, 3, 8, 1]
    seqs = [torch.randn(n, 5) for n in (4, 9, 4, 6)]  # each row's states, prompt then answer
    prompts = [2, 5, 3, 1]
    pool = Pool([s[:n] for s, n in zip(seqs, prompts)], windows)

    def check(rows, lengths):
        got = pool.pooled()
        for j, (i, n) in enumerate(zip(rows, lengths)):
            torch.testing.assert_close(got[j], pooled_positions(seqs[i][:n], windows[i])[-1])

    check(range(4), prompts)
    pool.push(torch.stack([s[n] for s, n in zip(seqs, prompts)]))
    check(range(4), [n + 1 for n in prompts])
    pool.keep(torch.tensor([1, 3]))  # rows 0 and 2 finished
    check([1, 3], [6, 2])
    extra = torch.randn(12, 5)
    seqs.append(extra)
    windows.append(16)
    pool.merge(Pool([extra[:10]], [16]))  # a row with a wider window joins
    check([1, 3, 4], [6, 2, 10])
    pool.push(torch.stack([seqs[1][6], seqs[3][2], extra[10]]))
    check([1, 3, 4], [7, 3, 11])


def test_window_sums_kept_step_by_step_stay_exact_over_a_long_answer():
    # each row's window sum is updated as a state enters and one leaves, and summed afresh every Pool.REFRESH steps:
    # over 700 steps of large states (rounding builds up fastest there) the pooled states are the exact means
    torch.manual_seed(1)
    windows, steps = [0, 4, 16, 1], 700
    seqs = [torch.randn(3 + steps, 64) * 10 + 100 for _ in windows]
    pool = Pool([s[:3] for s in seqs], windows)
    worst = 0.0
    for t in range(steps):
        pool.push(torch.stack([s[3 + t] for s in seqs]))
        if t % 50 == 0 or t == steps - 1 or t in (Pool.REFRESH - 1, Pool.REFRESH):
            want = torch.stack([s[:4 + t][-w if w else 0:].double().mean(0) for s, w in zip(seqs, windows)])
            worst = max(worst, float((pool.pooled().double() - want).abs().max() / want.abs().max()))
    assert worst < 1e-6, worst  # float32's own rounding of a mean of such states


def test_window_pooling_of_a_sequence_is_the_mean_of_its_last_tokens():
    h = torch.arange(12.0).reshape(6, 2)
    assert pooled_positions(h, 2)[-1].tolist() == [9.0, 10.0]  # mean of rows 4 and 5
    assert pooled_positions(h, 100)[-1].tolist() == h.mean(0).tolist()
    torch.testing.assert_close(pooled_positions(h, 0), h.cumsum(0) / torch.arange(1, 7.0)[:, None])


@pytest.fixture(scope="module")
def window_head(tiny_lm, tiny_records):
    return train_head(tiny_lm, *split_by_author(tiny_records, 1), FitConfig(pooling_window=4), progress=False)


def test_a_batch_pools_each_row_as_a_full_pass_over_its_text_would(tiny_lm, tiny_records, window_head):
    """Rows of a window head, a whole-context head and no head, of different prompt lengths (left padding), one
    joining later: after each step, each row's pooled state is what its head would read from a full pass."""
    head, info = window_head
    assert head.window == 4 and info.pooling == "window:4"
    mean_head, _ = train_head(tiny_lm, *split_by_author(tiny_records, 1), FitConfig(max_epochs=1, pooling_window=0), progress=False)
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    forget, retain = split_by_author(tiny_records, 1)
    prompts = ["A preamble of some words.\n" + question_prompt(forget[0]["question"]),
               question_prompt(retain[0]["question"]), question_prompt(forget[1]["question"])]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    rows = [(head, PRESETS["default"]), (mean_head, PRESETS["default"]), None]
    batch = Batch(model, tok, prompts[:2] + prompts[2:], [greedy] * 3, HeadGuide(rows))
    batch.step()
    batch.merge(Batch(model, tok, [prompts[0]], [greedy], HeadGuide([rows[0]])))
    for _ in range(3):
        batch.step()
        pooled = batch.pooled()
        for i, row in enumerate(batch.rows):
            ids = row.prompt_ids + row.token_ids
            with torch.inference_mode():
                hidden = forward_last_hidden(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                                             torch.arange(len(ids))[None], None)[0]
            window = 4 if i in (0, 3) else 0
            torch.testing.assert_close(pooled[i], pooled_positions(hidden, window)[-1], atol=2e-4, rtol=2e-4)
    batch.close()


def test_a_window_heads_file_says_its_pooling_and_other_poolings_are_refused(tiny_lm, window_head, tmp_path):
    head, info = window_head
    save_head(tmp_path / "w.safetensors", head, info)
    loaded, info2 = load_head(tmp_path / "w.safetensors", tiny_lm.fingerprint)
    assert loaded.window == 4 and info2.pooling == "window:4"
    for pooling in ("window:0", "window:x", "max", "window:99999"):
        meta = {"lethe": json.dumps({**info.__dict__, "pooling": pooling})}
        save_file(dict(head.state_dict()), str(tmp_path / "bad.safetensors"), metadata=meta)
        with pytest.raises(HeadFileError, match="metadata pooling: 'mean' or 'window:W'"):
            load_head(tmp_path / "bad.safetensors")


def test_pool_stays_exact_through_any_sequence_of_joins_and_departures():
    """Random joins (with wider, narrower or no windows) and departures, as continuous batching makes them: a
    batch whose widest-window row had left once failed the next join (the buffer was wider than any window)."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        rows, seqs = [], []

        def join(n):
            start = len(seqs)
            for _ in range(n):
                seqs.append([torch.randn(30, 3), rng.choice([0, 0, 1, 4, 16]), rng.randint(1, 6)])
            rows.extend(range(start, len(seqs)))
            new = range(start, len(seqs))
            return Pool([seqs[r][0][:seqs[r][2]] for r in new], [seqs[r][1] for r in new])

        pool = join(rng.randint(1, 4))
        for _ in range(10):
            if rng.random() < 0.3:
                pool.merge(join(rng.randint(1, 4)))
            elif len(rows) > 1 and rng.random() < 0.5:
                kept = sorted(rng.sample(range(len(rows)), rng.randint(1, len(rows))))
                pool.keep(torch.tensor(kept))
                rows[:] = [rows[i] for i in kept]
            got = pool.pooled()
            for j, r in enumerate(rows):
                h, window, n = seqs[r]
                torch.testing.assert_close(got[j], pooled_positions(h[:n], window)[-1])
            pool.push(torch.stack([seqs[r][0][seqs[r][2]] for r in rows]))
            for r in rows:
                seqs[r][2] += 1
