import math

import numpy as np
import pytest
import torch

from heads.tilt import candidates_of, guided_logits, restrict_to_candidates, tilt, tilt_among


def _reference_guide(base_logits: np.ndarray, head_logits: np.ndarray, base_temp: float, guidance_scale: float):
    """open-unlearning's T3CausalLM._guide_logits, written out element by element in float64."""
    out = np.empty_like(base_logits, dtype=np.float64)
    for i, (row, z) in enumerate(zip(base_logits.astype(np.float64), head_logits.astype(np.float64))):
        m = row.max()
        log_softmax = row - (m + math.log(np.exp(row - m).sum()))
        log_sigmoid = np.array([-math.log1p(math.exp(-v)) if v >= 0 else v - math.log1p(math.exp(v)) for v in z])
        out[i] = log_softmax / base_temp + guidance_scale * log_sigmoid
    return out


@pytest.mark.parametrize("T,lam", [(2.5, 1.0), (1.0, 0.0), (0.7, 3.0)])
def test_guided_logits_equal_the_reference_formula(T, lam):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 97, generator=g) * 5
    z = torch.randn(4, 97, generator=g) * 8
    got = guided_logits(logits, z, torch.full((4,), T), torch.full((4,), lam))
    want = _reference_guide(logits.numpy(), z.numpy(), T, lam)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-4)


def test_rows_carry_their_own_T_and_lam():
    logits, z = torch.randn(3, 11), torch.randn(3, 11)
    T, lam = torch.tensor([1.0, 2.5, 4.0]), torch.tensor([0.0, 1.0, 2.0])
    got = guided_logits(logits, z, T, lam)
    for i in range(3):
        torch.testing.assert_close(got[i], guided_logits(logits[i:i + 1], z[i:i + 1], T[i:i + 1], lam[i:i + 1])[0])


def test_gate_zero_is_the_base_model_and_gate_one_the_full_tilt():
    logits, z = torch.randn(2, 50), torch.randn(2, 50) * 4
    T, lam = torch.full((2,), 2.5), torch.full((2,), 3.0)
    torch.testing.assert_close(tilt(logits, z, T, lam, gate=torch.zeros(2)), torch.log_softmax(logits, -1))
    torch.testing.assert_close(tilt(logits, z, T, lam, gate=torch.ones(2)), guided_logits(logits, z, T, lam))


def test_candidates_keep_exactly_the_base_top_k():
    logits, z = torch.randn(3, 40), torch.randn(3, 40) * 10
    k = torch.tensor([1, 5, 0])
    out = restrict_to_candidates(guided_logits(logits, z, torch.ones(3), torch.ones(3)), logits, k)
    for i, kk in enumerate([1, 5, 40]):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == set(logits[i].topk(kk).indices.tolist())


def test_tilt_among_candidates_equals_the_dense_tilt():
    g = torch.Generator().manual_seed(3)
    logits, z = torch.randn(4, 60, generator=g) * 3, torch.randn(4, 60, generator=g) * 5
    T, lam, gate = torch.tensor([1.5, 2.5, 1.0, 3.0]), torch.tensor([4.0, 1.0, 0.0, 2.0]), torch.rand(4, generator=g)
    k = torch.tensor([20, 3, 1, 7])
    dense = tilt(logits, z, T, lam, gate, k)
    cand = candidates_of(logits, k)
    sparse = tilt_among(logits, cand, z.gather(1, cand), T, lam, gate)
    assert torch.equal(torch.isfinite(dense), torch.isfinite(sparse))
    # equal up to a constant per row: the same distribution
    torch.testing.assert_close(torch.softmax(sparse, -1), torch.softmax(dense, -1))


def test_cap_drops_a_flagged_spike_just_below_the_best_unflagged_token():
    logits = torch.tensor([[8.0, 2.0, 1.0, 0.0], [8.0, 2.0, 1.0, 0.0]])
    z = torch.tensor([[-5.0, 1.0, -1.0, 2.0], [-5.0, 1.0, -1.0, 2.0]])  # tokens 0 and 2 flagged
    T, lam, margin = torch.ones(2), torch.zeros(2), torch.full((2,), 0.5)
    gate = torch.tensor([1.0, 0.0])  # row 1: a retain context, no cap
    out = tilt(logits, z, T, lam, gate=gate, cap=margin)
    base = torch.log_softmax(logits, -1)
    assert out[0].argmax() == 1
    torch.testing.assert_close(out[0, 0], base[0, 1] - 0.5)  # capped at best unflagged - margin
    torch.testing.assert_close(out[0, 2], base[0, 2])  # already below the cap: unchanged
    torch.testing.assert_close(out[0, [1, 3]], base[0, [1, 3]])
    torch.testing.assert_close(out[1], base[1])


def test_cap_among_candidates_equals_the_dense_cap():
    g = torch.Generator().manual_seed(5)
    logits, z = torch.randn(3, 80, generator=g) * 4, torch.randn(3, 80, generator=g) * 3
    T, lam, k = torch.tensor([1.0, 2.0, 1.5]), torch.tensor([1.0, 0.5, 2.0]), torch.tensor([20, 5, 12])
    gate, cap = torch.tensor([0.9, 0.7, 0.2]), torch.tensor([0.5, 1.0, 0.5])
    dense = tilt(logits, z, T, lam, gate, k, cap)
    cand = candidates_of(logits, k)
    sparse = tilt_among(logits, cand, z.gather(1, cand), T, lam, gate, cap)
    assert torch.equal(torch.isfinite(dense), torch.isfinite(sparse))
    torch.testing.assert_close(torch.softmax(sparse, -1), torch.softmax(dense, -1))
