"""Abstention (issue 13): a profile may answer a prompt its head's probe calls forget-like with a plain reply."""

from __future__ import annotations

import torch

from lethe.heads.decoding.decode import generate
from lethe.heads.decoding.sampling import SamplingParams
from lethe.heads.t3.guide import HeadGuide, TiltSettings
from lethe.heads.t3.head import T3Head

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


def _head(lm, forget_bias: float) -> T3Head:
    """A head whose probe gives every context the same P(forget) = sigmoid(forget_bias); no tilt."""
    cfg = lm.model.config
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4).eval().requires_grad_(False)
    torch.nn.init.zeros_(head.probe.weight)
    head.probe.bias.fill_(-forget_bias)  # the probe's logit says "retain"
    return head


def test_a_confident_probe_answers_with_the_reply_and_others_decode_as_before(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    reply = tok.decode(tok.encode("Who wrote it", add_special_tokens=False))  # a text this small tokenizer spells
    sure, unsure = _head(tiny_lm, 5.0), _head(tiny_lm, 1.0)  # P(forget) 0.993 and 0.73
    abstain = TiltSettings(abstain=reply, lam=0.0, cap=None)
    prompts = ["Question: Where was the author born?\nAnswer:", "Question: What did she write?\nAnswer:"]
    base = generate(model, tok, prompts, GREEDY)
    for params in (GREEDY, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)):
        out = generate(model, tok, prompts, params, HeadGuide([(sure, abstain), (unsure, abstain)]))
        assert out[0].text == reply and out[0].finish_reason == "stop"
        alone = generate(model, tok, prompts[1:], params, HeadGuide([(unsure, abstain)]))[0]
        assert out[1].text == alone.text  # below abstain_above (0.9): decoded as usual, unchanged by its neighbour
    assert generate(model, tok, prompts[1:], GREEDY, HeadGuide([(unsure, abstain)]))[0].text == base[1].text
    lower = TiltSettings(abstain=reply, abstain_above=0.7, lam=0.0, cap=None)
    assert generate(model, tok, prompts[1:], GREEDY, HeadGuide([(unsure, lower)]))[0].text == reply


def test_abstain_settings_are_checked():
    import pytest

    for bad in ({"abstain": ""}, {"abstain": "x" * 501}, {"abstain_above": 0.2}, {"abstain_above": 1.0},
                {"abstain": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TiltSettings().replace(**bad)
