"""ASU's teacher: tempered attention through transformers' attention interface."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lethe.heads.asu.attention import attention_modules, tempered, use_tempered_attention


def _tiny(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    model = LlamaForCausalLM(LlamaConfig(**common)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    return model.eval()


def _batch():
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    ids[mask == 0] = 0
    return ids, mask


def _logits(model, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tau_one_reproduces_the_stock_logits_exactly(family):
    model = _tiny(family)
    ids, mask = _batch()
    stock = _logits(model, ids, mask)
    use_tempered_attention(model)
    torch.testing.assert_close(_logits(model, ids, mask), stock, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tau_two_equals_eager_attention_at_half_the_scaling(family):
    model = _tiny(family)
    ids, mask = _batch()
    model.set_attn_implementation("eager")
    for m in attention_modules(model):
        m.scaling = m.scaling / 2
    want = _logits(model, ids, mask)
    for m in attention_modules(model):
        m.scaling = m.scaling * 2
    use_tempered_attention(model)
    with tempered(model, 2.0, [0, 1]):
        got = _logits(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(model, ids, mask)[real], _logits(_tiny(family), ids, mask)[real]), \
        "outside the block, tau is back to 1"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_left_padded_batch_equals_each_row_alone_when_tempered(family):
    model = _tiny(family)
    use_tempered_attention(model)
    ids, mask = _batch()
    with tempered(model, 3.0, [1]):
        together = _logits(model, ids, mask)
        for r in range(3):
            keep = mask[r].bool()
            alone = _logits(model, ids[r:r + 1, keep], mask[r:r + 1, keep])
            torch.testing.assert_close(together[r, keep], alone[0], atol=1e-5, rtol=1e-5)


def test_tempering_only_the_chosen_layers_changes_the_output():
    model = _tiny("llama")
    use_tempered_attention(model)
    ids, mask = _batch()
    base = _logits(model, ids, mask)
    with tempered(model, 4.0, [1]):
        one = _logits(model, ids, mask)
    with tempered(model, 4.0, [0, 1]):
        both = _logits(model, ids, mask)
    assert not torch.allclose(one, base) and not torch.allclose(one, both)
