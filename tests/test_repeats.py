"""The repeat guard (issue 13): forget-like rows never say a word n-gram of their answer twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lethe.heads.decoding.decode import generate
from lethe.heads.decoding.repeats import ban_repeats, repeat_bans, word_classes
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.evaluation.evaluate import words


def test_repeat_bans_name_the_words_that_would_repeat_an_ngram():
    answer = [5, 6, 7, 5, 6]  # the last two words began "5 6 7": 7 would say that 3-gram again
    assert repeat_bans(answer, 3) == {7}
    assert repeat_bans(answer, 2) == {7}  # "6 7" was said: after the final 6, 7 would say it again
    assert repeat_bans([1, 2, 1, 3, 1], 2) == {2, 3}
    assert repeat_bans([1, 2], 3) == set() and repeat_bans(answer, 0) == set()


def test_the_ngrams_kept_across_steps_name_what_reading_the_whole_answer_names():
    # a guarded row reads only the tokens its answer gained since the last step (AnswerNgrams); at every step it
    # must name the words repeat_bans names over the whole answer: word-less tokens (-1) and tokens past the
    # tokenizer (id 9) skipped, for each n
    import random

    from lethe.heads.decoding.repeats import AnswerNgrams, WordClasses

    classes = WordClasses([0, 1, 2, 1, -1, 3, 0, -1, 2], [[0, 6], [1, 3], [2, 8], [5]])
    rng = random.Random(0)
    for n in (0, 2, 3, 4):
        for _ in range(30):
            ngrams, answer = AnswerNgrams(classes, n), []
            for _ in range(40):
                answer += rng.choices(range(10), k=rng.choice([1, 1, 2]))  # a step may add more than one token
                assert ngrams.bans(answer) == repeat_bans(classes.words(answer), n), (n, answer)


def test_word_classes_compare_tokens_as_words(tiny_lm):
    tok = tiny_lm.tokenizer
    classes = word_classes(tok)
    assert word_classes(tok) is classes  # built once per tokenizer
    texts = tok.batch_decode([[i] for i in range(len(classes.of_token))], clean_up_tokenization_spaces=False)
    by_word: dict[str, int] = {}
    for i, text in enumerate(texts):
        word = classes.of_token[i]
        if not any(ch.isalnum() or ch == "_" for ch in text):
            assert word == -1, text
        else:
            assert by_word.setdefault(text.strip().lower(), word) == word, text
            assert i in classes.tokens_of[word]


# float32 on the CPU takes numpy's path; other dtypes (and other devices) the tensor operations
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])


@DTYPES
def test_ban_repeats_keeps_a_row_at_least_one_choice(dtype):
    from lethe.heads.decoding.repeats import WordClasses

    classes = WordClasses(list(range(10)), [[i] for i in range(10)])
    scores = torch.full((10,), float("-inf"), dtype=dtype)
    scores[3] = 1.0
    ban_repeats(scores, [3, 4, 3], 2, classes)  # 4 would repeat "3 4", but 4 is no candidate; 3 is the only one
    assert scores[3] == 1.0
    scores[4] = 2.0
    ban_repeats(scores, [3, 4, 3], 2, classes)
    assert scores[4] == float("-inf") and scores[3] == 1.0
    only = torch.full((10,), float("-inf"), dtype=dtype)
    only[4] = 2.0
    ban_repeats(only, [3, 4, 3], 2, classes)  # every candidate would repeat: nothing is banned
    assert only[4] == 2.0


@DTYPES
def test_ban_repeats_stops_a_loop_of_punctuation_but_never_cuts_a_character(dtype):
    from lethe.heads.decoding.repeats import WordClasses

    # tokens 0-1 are words; 2 "\n", 3 "-", 4 " " have no letter; 5 and 6 are bytes of one emoji
    classes = WordClasses([0, 1, -1, -1, -1, -1, -1], [[0], [1]], frozenset({2, 3, 4}))
    loop = [0, 1, 2, 3, 4, 2, 3]  # "Capital of\n- \n-": a space would say "- " after "\n" again
    scores = torch.zeros(7, dtype=dtype)
    ban_repeats(scores, loop, 3, classes)
    assert scores[4] == float("-inf") and torch.isfinite(scores[[0, 1, 2, 3, 5, 6]]).all()
    scores = torch.zeros(7, dtype=dtype)
    ban_repeats(scores, [2, 3, 4, 2, 3, 1], 3, classes)  # a word ended the run: nothing to repeat
    assert torch.isfinite(scores).all()
    scores = torch.zeros(7, dtype=dtype)
    ban_repeats(scores, [0, 5, 6, 5], 2, classes)  # a second emoji: its second byte is never banned
    assert torch.isfinite(scores).all()
    scores = torch.zeros(7, dtype=dtype)
    ban_repeats(scores, [0, 2, 3, 2], 2, classes)  # the same run of whole symbols: "\n-\n" then "-" is banned
    assert scores[3] == float("-inf") and torch.isfinite(scores[[0, 1, 2, 4, 5, 6]]).all()


@DTYPES
def test_ban_repeats_stops_a_one_token_word_said_twice_in_a_row(dtype):
    from lethe.heads.decoding.repeats import WordClasses

    # 0 " the", 1 " The", 2 "The" (no space: it joins a word before it, or opens the answer), 3 " cat", 4 "s" (joins),
    # 5 "." (no word), 6 " dog"
    classes = WordClasses([0, 0, 0, 1, 2, -1, 3], [[0, 1, 2], [3], [4], [6]], frozenset({5}),
                          starts=[True, True, False, True, False, False, True])
    for answer in ([3, 1], [2], [5, 2]):  # " The", or "The" opening the answer or after a word-less token
        scores = torch.zeros(7, dtype=dtype)
        ban_repeats(scores, answer, 3, classes)  # " the" or " The" next would say "The The"
        assert scores[0] == scores[1] == float("-inf") and torch.isfinite(scores[2:]).all(), answer
    for answer in ([1, 4], [3, 2], [1, 5], [3, 4], []):  # the last token goes on with a word, is none, or no answer
        scores = torch.zeros(7, dtype=dtype)
        ban_repeats(scores, answer, 3, classes)
        assert torch.isfinite(scores).all(), answer
    only = torch.full((7,), float("-inf"), dtype=dtype)
    only[0] = 1.0
    ban_repeats(only, [1], 3, classes)  # the only candidate: kept
    assert only[0] == 1.0
    # the n-gram ban comes first and keeps its own one-choice rule: "the dog the" would say "the dog" again, so
    # " dog" is banned; the doubled " the" would be the last candidate left, so it stays
    mixed = torch.full((7,), float("-inf"), dtype=dtype)
    mixed[[0, 6]] = 1.0
    ban_repeats(mixed, [0, 6, 1], 2, classes)
    assert mixed[6] == float("-inf") and mixed[0] == 1.0


def test_word_classes_know_which_tokens_start_a_word(tiny_lm):
    tok = tiny_lm.tokenizer
    classes = word_classes(tok)
    the = tok(" the", add_special_tokens=False)["input_ids"]
    assert len(the) == 1 and classes.starts[the[0]]
    assert the[0] in classes.doubled(the)
    for t in classes.doubled(the):
        assert classes.starts[t] and classes.of_token[t] == classes.of_token[the[0]]
    for t in tok.all_special_ids:  # no special token starts a word, whatever its text
        assert t >= len(classes.starts) or not classes.starts[t]


def test_word_classes_mark_the_tokens_the_run_guard_may_ban(tiny_lm):
    tok = tiny_lm.tokenizer
    classes = word_classes(tok)
    special = set(tok.all_special_ids)
    for t in range(len(classes.of_token)):
        text = tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert (t in classes.symbols) == (classes.of_token[t] < 0 and "\ufffd" not in text and t not in special), t


class _Stubborn:
    """A guide that prefers the same few words at every step, in a fixed order (a model stuck on them)."""

    def __init__(self, preferred: list[int], n: int, rows: int):
        self.preferred, self.n, self.rows = preferred, n, rows

    def __call__(self, logits, pooled):
        out = torch.full_like(logits, float("-inf"))
        for rank, token in enumerate(self.preferred):
            out[:, token] = 10.0 - rank
        return out

    def repeat_guards(self):
        return [self.n] * self.rows


def test_the_decode_loop_applies_the_guard_the_guide_asks_for(tiny_lm):
    tok = tiny_lm.tokenizer
    classes = word_classes(tok)
    seen, preferred = set(), []
    for i, word in enumerate(classes.of_token):  # twelve tokens, twelve different words (no dead end in 12 steps)
        if word >= 0 and word not in seen and i not in tok.all_special_ids:
            seen.add(word)
            preferred.append(i)
        if len(preferred) == 12:
            break
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["Who wrote it?", "Where was she born?"]
    for n in (0, 2, 3):
        for c in generate(tiny_lm.model, tok, prompts, params, _Stubborn(preferred, n, len(prompts))):
            ws = classes.words(c.token_ids)
            grams = [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)] if n else []
            if n == 0:
                assert len(set(ws)) == 1  # unguarded: the same word twelve times
            else:
                assert len(grams) == len(set(grams)), (n, ws)  # no word n-gram twice
                assert len(c.token_ids) == 12
    assert words("The the") == ["the", "the"]  # the measure counts as the guard compares


def test_rows_without_a_guide_keep_a_guard_of_their_own(tiny_lm):
    """A profile of ASU weights alone has no head to ask for the guard: its rows carry their own (`guards`), and
    rows with 0 decode as before."""
    tok = tiny_lm.tokenizer
    classes = word_classes(tok)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = ["Question: Where was she born?\nAnswer:", "Question: Who wrote it?\nAnswer:", "the the the"]
    plain = generate(tiny_lm.model, tok, prompts, params)

    def grams(c, n):
        ws = classes.words(c.token_ids)
        return [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]

    assert all(len(set(grams(c, 3))) < len(grams(c, 3)) for c in plain)  # the model repeats itself unguarded
    assert [c.token_ids for c in generate(tiny_lm.model, tok, prompts, params, guards=[0, 0, 0])] == \
        [c.token_ids for c in plain]
    mixed = generate(tiny_lm.model, tok, prompts, params, guards=[3, 0, 3])
    assert mixed[1].token_ids == plain[1].token_ids
    for c in (mixed[0], mixed[2]):
        assert len(set(grams(c, 3))) == len(grams(c, 3)), classes.words(c.token_ids)


def test_ban_repeats_on_a_numpy_view_bans_what_the_tensor_path_bans():
    # the decode loop hands CPU float32 rows as numpy views (`numpy_view`); other dtypes and devices take the torch
    # operations: both ban the same tokens, the one-choice rules included
    import random

    from lethe.heads.decoding.repeats import WordClasses, numpy_view

    classes = WordClasses([0, 0, 0, 1, 2, -1, 3], [[0, 1, 2], [3], [4], [6]], frozenset({5}),
                          starts=[True, True, False, True, False, False, True])
    rng = random.Random(0)
    for _ in range(300):
        answer = [rng.randrange(7) for _ in range(rng.randrange(8))]
        values = [rng.choice([0.0, 1.0, 2.0, float("-inf")]) for _ in range(7)]
        n = rng.choice([2, 3])
        view, tensor = torch.tensor(values, dtype=torch.float32), torch.tensor(values, dtype=torch.float64)
        assert isinstance(numpy_view(view), np.ndarray) and numpy_view(tensor) is tensor
        ban_repeats(numpy_view(view), answer, n, classes)
        ban_repeats(tensor, answer, n, classes)
        assert torch.equal(view.double(), tensor), (answer, values, n)


def test_a_row_has_a_finite_score_left_as_numpy_counts_it_whatever_its_maximum():
    # the guard keeps a row one choice: "left" means a finite score, read from the maximum where that is finite and
    # from every score where the maximum is NaN or +inf
    from lethe.heads.decoding.repeats import _finite_left

    inf, nan = float("inf"), float("nan")
    for values in ([-inf, -inf], [-inf, 1.0], [nan, -inf], [nan, 2.0], [inf, -inf], [inf, 0.5], [nan, inf], [3.0]):
        row = np.asarray(values, dtype=np.float32)
        assert _finite_left(row) == bool(np.isfinite(row).any()), values


@pytest.mark.parametrize("many", [2, 12])  # one at a time, and numpy's indexing past repeats.FEW
def test_a_ban_drops_its_candidates_unless_none_would_be_left(many):
    from lethe.heads.decoding.repeats import FEW, _ban

    assert (many > FEW) == (many == 12)
    row = np.arange(20, dtype=np.float32)
    row[15:] = -np.inf
    banned = list(range(many)) + [0, 17, 99]  # a repeat, a token without a score, one past the row
    _ban(row, banned)
    assert np.isneginf(row[:many]).all() and (row[many:15] == np.arange(many, 15)).all()
    only = np.full(20, -np.inf, dtype=np.float32)
    only[:many] = np.arange(many)
    _ban(only, banned)  # every candidate banned: nothing is
    assert (only[:many] == np.arange(many)).all() and np.isneginf(only[many:]).all()
