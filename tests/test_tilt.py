import dataclasses
import math

import numpy as np
import pytest
import torch

from lethe.heads.t3.tilt import candidates_of, guided_logits, restrict_to_candidates, tilt, tilt_candidates


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


def test_a_context_the_gate_keeps_out_gets_the_base_logits_untouched_and_gate_one_the_full_tilt():
    logits, z = torch.randn(3, 50), torch.randn(3, 50) * 4
    T, lam = torch.full((3,), 2.5), torch.full((3,), 3.0)
    kept_out = tilt(logits, z, T, lam, gate=torch.tensor([0.0, 0.3, 0.5]), candidates=torch.full((3,), 5),
                    cap=torch.full((3,), 0.5), min_p=torch.full((3,), 0.1))
    assert torch.equal(kept_out, logits)  # exactly: a retain answer is the base model's, sampled ones too
    torch.testing.assert_close(tilt(logits, z, T, lam, gate=torch.ones(3)), guided_logits(logits, z, T, lam))


def test_candidates_keep_exactly_the_base_top_k():
    logits, z = torch.randn(3, 40), torch.randn(3, 40) * 10
    k = torch.tensor([1, 5, 0])
    out = restrict_to_candidates(guided_logits(logits, z, torch.ones(3), torch.ones(3)), logits, k)
    for i, kk in enumerate([1, 5, 40]):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == set(logits[i].topk(kk).indices.tolist())


def _among(logits, z, k, T, lam, gate, cap=None, push=None):
    """The decode loop's candidate path, scattered back over the vocabulary (-inf elsewhere)."""
    keep = torch.arange(int(k.max()))[None, :] < k[:, None]
    values, ids = candidates_of(logits, int(k.max()), keep)
    col = lambda v: None if v is None else v[:, None]  # noqa: E731
    scores = tilt_candidates(values, z.gather(1, ids), col(T), col(lam), col(gate), col(cap), push=col(push))
    out = torch.full_like(logits, float("-inf")).scatter(-1, ids, scores)
    return out if gate is None else torch.where(gate[:, None] > 0.5, out, logits)  # as `_Group` does


def test_tilt_among_candidates_equals_the_dense_tilt():
    g = torch.Generator().manual_seed(3)
    logits, z = torch.randn(4, 60, generator=g) * 3, torch.randn(4, 60, generator=g) * 5
    T, lam, gate = torch.tensor([1.5, 2.5, 1.0, 3.0]), torch.tensor([4.0, 1.0, 0.0, 2.0]), torch.rand(4, generator=g)
    k = torch.tensor([20, 3, 1, 7])
    dense = tilt(logits, z, T, lam, gate, k)
    sparse = _among(logits, z, k, T, lam, gate)
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
    assert torch.equal(out[1], logits[1])


@pytest.mark.parametrize("push", [None, torch.tensor([2.0, 0.5, float("inf")])])
def test_cap_among_candidates_equals_the_dense_cap(push):
    g = torch.Generator().manual_seed(5)
    logits, z = torch.randn(3, 80, generator=g) * 4, torch.randn(3, 80, generator=g) * 6
    T, lam, k = torch.tensor([1.0, 2.0, 1.5]), torch.tensor([3.0, 0.5, 2.0]), torch.tensor([20, 5, 12])
    gate, cap = torch.tensor([0.9, 0.7, 0.2]), torch.tensor([0.5, 1.0, 0.5])
    dense = tilt(logits, z, T, lam, gate, k, cap, push=push)
    sparse = _among(logits, z, k, T, lam, gate, cap, push)
    assert torch.equal(torch.isfinite(dense), torch.isfinite(sparse))
    torch.testing.assert_close(torch.softmax(sparse, -1), torch.softmax(dense, -1))
    if push is not None:  # the limit raised some flagged candidate: the comparison covered it
        assert not torch.allclose(torch.softmax(dense, -1), torch.softmax(tilt(logits, z, T, lam, gate, k, cap), -1))


def test_the_push_limit_holds_a_flagged_token_at_most_max_push_below_where_the_cap_holds_it():
    logits = torch.tensor([[8.0, 2.0, 1.0, 0.0, -3.0]] * 2)
    z = torch.tensor([[-20.0, 30.0, -20.0, 30.0, -0.1]] * 2)  # tokens 0, 2 and 4 flagged; 0 and 2 pushed 20 nats
    T, lam, cap = torch.ones(2), torch.ones(2), torch.full((2,), 0.5)
    push = torch.tensor([2.0, float("inf")])  # row 1: no limit
    out = tilt(logits, z, T, lam, gate=torch.ones(2), cap=cap, push=push)
    base = torch.log_softmax(logits, -1)
    tilted = base + torch.nn.functional.logsigmoid(z)
    torch.testing.assert_close(out[0, 0], base[0, 1] - 0.5 - 2.0)  # the spike: 2 nats below the cap's limit
    torch.testing.assert_close(out[0, 2], base[0, 2] - 2.0)  # below the limit already: 2 nats below its own score
    torch.testing.assert_close(out[0, 4], tilted[0, 4])  # pushed less than 2 nats: as tilted
    torch.testing.assert_close(out[0, [1, 3]], base[0, [1, 3]])  # unflagged: untouched
    assert int(out[0].argmax()) == 1
    torch.testing.assert_close(out[1], torch.minimum(tilted[1], base[1, 1] - 0.5) * (z[1] < 0) + base[1] * (z[1] >= 0))
    # without a cap, no limit; a token outside the candidates stays without a score
    torch.testing.assert_close(tilt(logits, z, T, lam, gate=torch.ones(2), push=push), tilted)
    few = tilt(logits, z, T, lam, gate=torch.ones(2), candidates=torch.full((2,), 2), cap=cap, push=push)
    assert not torch.isfinite(few[:, 2:]).any()


def test_candidate_path_without_tempering_or_gate_and_with_a_row_whose_cap_is_off():
    g = torch.Generator().manual_seed(7)
    logits, z = torch.randn(3, 50, generator=g) * 4, torch.randn(3, 50, generator=g) * 3
    k, lam = torch.tensor([10, 10, 10]), torch.tensor([1.0, 2.0, 0.5])
    cap = torch.tensor([0.5, float("-inf"), 1.0])  # row 1: no cap
    dense = tilt(logits, z, torch.ones(3), lam, None, k, torch.tensor([0.5, -1.0, 1.0]))
    values, ids = candidates_of(logits, 10)
    scores = tilt_candidates(values, z.gather(1, ids), None, lam[:, None], None, cap[:, None])
    sparse = torch.full_like(logits, float("-inf")).scatter(-1, ids, scores)
    torch.testing.assert_close(torch.softmax(sparse, -1), torch.softmax(dense, -1))


def test_cap_leaves_a_row_whose_candidates_are_all_flagged_unchanged():
    values = torch.tensor([[3.0, 2.0, 1.0]])
    z = torch.tensor([[-1.0, -2.0, -3.0]])  # every candidate flagged: nothing to fall below
    scores = tilt_candidates(values, z, None, torch.zeros(1, 1), None, torch.full((1, 1), 0.5))
    torch.testing.assert_close(scores, values)


@pytest.mark.parametrize("fused", [True, False])  # the CPU kernel, and the tensor operations
@pytest.mark.parametrize("rows", [4, 5])  # 4: the candidate path; 5: a row over the whole vocabulary joins
def test_head_guide_gives_each_row_of_a_mixed_group_its_own_dense_tilt(rows, fused):
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    torch.manual_seed(11)
    head = T3Head(16, 70, 4).eval().requires_grad_(False)
    torch.nn.init.normal_(head.up.weight, std=3.0)
    torch.nn.init.normal_(head.probe.weight, std=0.5)
    settings = [TiltSettings(max_push=2.0), TiltSettings(T=2.0, lam=3.0, candidates=5, min_p=0.05),
                TiltSettings(gate=False, cap=None), TiltSettings(T=1.5, cap=1.0, candidates=12, min_p=0.3),
                TiltSettings(T=2.5, gate=False, candidates=0, cap=None, min_p=0.01)]
    settings = settings[:rows]
    logits, pooled = torch.randn(rows, 70) * 3, torch.randn(rows, 16)
    with torch.inference_mode():
        got = HeadGuide([(head, s) for s in settings], fused=fused)(logits, pooled)
        for i, s in enumerate(settings):
            one = lambda v: torch.tensor([float(v)])  # noqa: E731
            gate = head.forget_probability(pooled[i:i + 1]) if s.gate else None
            want = tilt(logits[i:i + 1], head(pooled[i:i + 1]), one(s.T), one(s.lam), gate,
                        torch.tensor([s.candidates]), None if s.cap is None else one(s.cap),
                        one(s.min_p) if s.min_p else None, one(s.flagged_mass) if s.flagged_mass else None,
                        push=None if s.max_push is None else one(s.max_push))
            assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want[0])), i
            torch.testing.assert_close(torch.softmax(got[i], -1), torch.softmax(want[0], -1))
    assert any(not torch.equal(got[i], logits[i]) for i in range(rows))  # some row was tilted: the check compared tilts


def test_whole_words_drops_the_starts_the_model_would_go_on_spelling_and_holds_the_flagged_under_what_is_left():
    """Budapest flagged and turned away: " Br" (the base model's next best start, which it can only finish with
    letters of its own: "atisl" + "ál") is dropped for " the", whose word ends there, and so is a start no lookahead
    reached; the flagged token keeps the probability it had (no more: a sampled answer is no likelier to give it) and
    stays under " the" minus the cap. Where no start ends, nothing changes; with the cap off, nothing changes where
    the flagged token would then come first."""
    from lethe.heads.t3.tilt import keep_whole_words, word_ends

    joins = torch.tensor([False, False, False, True, True, False, False])  # 3, 4: pieces continuing a word; 5: "."
    flagged, br, the, punct, unseen = 0, 1, 2, 5, 6
    scores = torch.tensor([3.5, 4.0, 3.0, float("-inf"), float("-inf"), 2.0, 1.0])
    nxt = torch.full((2, 7), -9.0)
    nxt[0, 3] = 5.0  # after " Br": a piece that continues the word, almost surely
    nxt[1, punct] = 5.0  # after " the": the word ends
    ends = word_ends(nxt, joins)
    assert ends[0] < 0.01 and ends[1] > 0.99
    starts, f = torch.tensor([br, the, unseen]), torch.tensor([flagged])  # `unseen`: past the lookahead
    out = keep_whole_words(scores.clone(), starts, ends, f, 0.5)
    assert out[br] == float("-inf") and out[unseen] == float("-inf") and out[the] == 3.0 and out[punct] == 2.0
    assert int(out.argmax()) == the and out[flagged] <= 3.0 - 0.5
    torch.testing.assert_close(out.softmax(0)[flagged], scores.softmax(0)[flagged])  # its probability, not more
    uncapped = keep_whole_words(scores.clone(), starts, ends, f, None)
    assert uncapped[br] == float("-inf") and int(uncapped.argmax()) == the
    torch.testing.assert_close(uncapped.softmax(0)[flagged], scores.softmax(0)[flagged])
    leading = scores.clone()
    leading[flagged] = 4.5  # ahead of " the" even after losing the dropped share: with the cap off, kept as it was
    assert torch.equal(keep_whole_words(leading.clone(), starts, ends, f, None), leading)
    assert int(keep_whole_words(leading.clone(), starts, ends, f, 0.5).argmax()) == the
    assert torch.equal(keep_whole_words(scores.clone(), starts, torch.tensor([0.2, 0.3]), f, 0.5), scores)


def test_whole_words_is_a_boolean_setting_off_unless_a_profile_asks():
    from lethe.heads.t3.guide import PRESETS, TiltSettings

    assert not TiltSettings().whole_words and not PRESETS["paper"].whole_words
    assert not TiltSettings.from_dict({"T": 2.0, "word_guard": True}).whole_words
    assert TiltSettings.from_dict({"whole_words": True}).whole_words
    with pytest.raises(ValueError, match="whole_words: must be true or false"):
        TiltSettings.from_dict({"whole_words": 1})


@pytest.mark.parametrize("probe,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("batch", [1, 6, 14])  # 14: every choice below once
def test_cpu_kernel_equals_the_tensor_operations(probe, bias, batch):
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    torch.manual_seed(batch)
    head = T3Head(24, 90, 5, bias=bias, probe=probe).eval().requires_grad_(False)
    torch.nn.init.normal_(head.up.weight, std=3.0)
    if bias:
        torch.nn.init.normal_(head.up.bias)
    if probe:
        torch.nn.init.normal_(head.probe.weight, std=0.5)
    choices = [TiltSettings(), TiltSettings(T=2.5, lam=2.0, candidates=7), TiltSettings(gate=False, cap=None),
               TiltSettings(T=1.5, cap=2.0, candidates=100), TiltSettings(lam=0.0), TiltSettings(cap=0.0, candidates=1),
               TiltSettings(min_p=0.1, candidates=30, gate=False), TiltSettings(head_gate=1.0),
               TiltSettings(head_gate=3.0, T=2.0, candidates=9), TiltSettings(flagged_mass=0.3),
               TiltSettings(flagged_mass=0.05, T=2.0, candidates=9, min_p=0.05), TiltSettings(max_push=0.0, lam=5.0),
               TiltSettings(max_push=4.0, T=2.0, lam=4.0, candidates=30), TiltSettings(max_push=2.0, gate=False)]
    rows = [(head, choices[i % len(choices)]) for i in range(batch)]
    logits, pooled = torch.randn(batch, 90) * 4, torch.randn(batch, 24) * 2
    with torch.inference_mode():
        kernel = HeadGuide(rows, fused=True)(logits, pooled)
        tensor_ops = HeadGuide(rows, fused=False)(logits, pooled)
    assert torch.equal(torch.isfinite(kernel), torch.isfinite(tensor_ops))
    torch.testing.assert_close(torch.softmax(kernel, -1), torch.softmax(tensor_ops, -1), atol=1e-5, rtol=1e-4)
    assert torch.equal(kernel.argmax(-1), tensor_ops.argmax(-1))


def test_the_cpu_kernel_can_be_turned_off(monkeypatch):
    from lethe.heads.t3.guide import HeadGuide

    assert HeadGuide([]).fused
    monkeypatch.setenv("LETHE_FUSED_TILT", "0")
    assert not HeadGuide([]).fused



def test_a_numba_cache_written_under_another_module_name_is_recompiled_not_fatal(tmp_path):
    """A disk cache from before Lethe's packages were `lethe.*` names a module that no longer exists: loading it
    failed every request with a head, until the cache was dropped. Now it is recompiled, with a warning."""
    import subprocess
    import sys

    pytest.importorskip("numba")
    import lethe.heads.t3.fused as fused

    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    old_layout = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('old_fused', sys.argv[1]);"
                  "m = importlib.util.module_from_spec(spec); sys.modules['old_fused'] = m; spec.loader.exec_module(m);"
                  "m.warm_up()")
    subprocess.run([sys.executable, "-c", old_layout, fused.__file__], env=env, check=True, timeout=300)
    assert list(tmp_path.rglob("*.nbi")), "the old layout's cache was written"
    now = subprocess.run([sys.executable, "-c", "from lethe.heads.t3 import fused; fused.warm_up(); print('ok')"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert now.returncode == 0 and now.stdout.strip() == "ok", now.stderr[-2000:]
    assert "compiling it again" in now.stderr


def _probed_head(seed: int):
    """A small head (d 8, vocabulary 40, rank 3) with spread logits and a probe along a random direction: its retain
    logit is direction . pooled, so P(forget) = sigmoid(-direction . pooled). Returns (head, direction)."""
    from lethe.heads.t3.head import T3Head

    torch.manual_seed(seed)
    head = T3Head(8, 40, 3).eval().requires_grad_(False)
    torch.nn.init.normal_(head.up.weight, std=3.0)
    direction = torch.randn(8)
    with torch.no_grad():
        head.probe.weight.copy_(direction[None, :])
    return head, direction


@pytest.mark.parametrize("path", ["fused", "candidates", "dense"])  # the CPU kernel, tensor operations, no candidates
def test_a_sticky_gate_stays_open_for_the_rest_of_the_answer_once_it_opened(path):
    # a row whose context is forget-like at one step and not at the next: today's gate closes again (base logits
    # back), a sticky gate stays at the highest P(forget) its answer had, so the row is still tilted; a row
    # without the setting, in the same batch, is not affected
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    head, direction = _probed_head(5)
    forget_like, retain_like = -direction * 2, direction * 2
    assert head.forget_probability(forget_like[None])[0] > 0.9 > 0.1 > head.forget_probability(retain_like[None])[0]
    # every step the gate lets in is tilted (flagged_mass off): these random logits need not hold a likely flagged token
    extra = {"fused": {}, "candidates": {}, "dense": {"candidates": 0}}[path] | {"flagged_mass": 0.0}
    sticky, plain = TiltSettings(sticky_gate=True, **extra), TiltSettings(sticky_gate=False, **extra)
    guide = HeadGuide([(head, sticky), (head, plain)], fused=path == "fused")
    logits = torch.randn(2, 40) * 3
    with torch.inference_mode():
        first = guide(logits, torch.stack([forget_like, forget_like])).clone()
        assert not torch.equal(first[0], logits[0]) and not torch.equal(first[1], logits[1])  # both tilted
        then = guide(logits, torch.stack([retain_like, retain_like])).clone()
    torch.testing.assert_close(then[1], logits[1])  # the plain gate closed: base logits untouched
    assert not torch.equal(then[0], logits[0]) and guide.floor[0] > 0.9 and guide.floor[1] == 0
    with torch.inference_mode():  # the sticky row is tilted as at the gate it had when it opened
        opened = HeadGuide([(head, TiltSettings(gate=False, **extra))], fused=False)(logits[:1], retain_like[None])
    assert torch.equal(then[0].argmax(), opened[0].argmax())


def test_sticky_floors_of_every_row_match_between_the_kernel_and_tensor_operations_over_many_steps():
    # every row sticky, one head (the default batch): the kernel's floors live in its own gate buffer from step to
    # step (no copy); they must be what the tensor operations keep, at every step, and survive dropping a row
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    head, direction = _probed_head(5)
    states = [-direction * 2, direction * 2, direction * 0.1, -direction * 0.1, direction * 2]
    settings = TiltSettings(flagged_mass=0.0)
    fused, ops = HeadGuide([(head, settings)] * 3, fused=True), HeadGuide([(head, settings)] * 3, fused=False)
    logits = torch.randn(3, 40) * 3
    with torch.inference_mode():
        seen = [[] for _ in range(3)]
        for step in range(4):  # each row meets four of the states, in its own order (row 1 never the first)
            pooled = torch.stack([states[(step + i) % len(states)] for i in range(3)])
            for i in range(3):
                seen[i].append(pooled[i])
            a, b = fused(logits, pooled).clone(), ops(logits, pooled)
            torch.testing.assert_close(fused.floor, ops.floor)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        highest = torch.stack([head.forget_probability(torch.stack(s)).amax() for s in seen])
        assert highest[1] < highest[0] - 0.05  # the rows' floors differ: a row given another's would show
        torch.testing.assert_close(fused.floor, highest)
        kept_fused, kept_ops = fused.kept([1, 0]), ops.kept([1, 0])
        pooled = torch.stack([direction * 2, direction * 2])
        kept_fused(logits[[1, 0]], pooled), kept_ops(logits[[1, 0]], pooled)
        torch.testing.assert_close(kept_fused.floor, highest[[1, 0]])
        torch.testing.assert_close(kept_fused.floor, kept_ops.floor)


def test_sticky_gate_is_a_boolean_setting():
    from lethe.heads.t3.guide import TiltSettings

    assert TiltSettings().sticky_gate and not TiltSettings.from_dict({"sticky_gate": False}).sticky_gate
    with pytest.raises(ValueError, match="sticky_gate: must be true or false"):
        TiltSettings.from_dict({"sticky_gate": 1})


@pytest.mark.parametrize("path", ["fused", "candidates", "dense", "scoring"])
def test_the_head_gate_opens_a_row_the_probe_keeps_out_where_the_head_flags_the_likeliest_token(path):
    """head_gate: earlier turns can make a forget question look retain-like to the probe, while the head still flags
    the fact; where it scores the base model's likeliest token below -head_gate the row is tilted (fully, and for the
    rest of the answer with the sticky gate), and where it does not the row keeps its base logits."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, direction = _probed_head(3)
    pooled = (direction * 2)[None].repeat(2, 1)  # the probe calls both rows retain-like
    assert float(head.forget_probability(pooled[:1])[0]) < 0.1
    z = head(pooled)[0]
    logits = torch.full((2, 40), -5.0)
    flagged, free = int(z.argmin()), int(z.argmax())  # the head's most forget-like and most retain-like tokens
    logits[0, flagged], logits[1, free] = 5.0, 5.0  # row 0's likeliest token is flagged, row 1's is not
    threshold = float(-z[flagged]) - 0.5
    assert z[flagged] < -threshold < 0 < z[free]
    # flagged_mass off: the sticky step below holds no likely flagged token, and is still tilted
    extra = {"fused": {}, "candidates": {}, "dense": {"candidates": 0}, "scoring": {}}[path] | {"flagged_mass": 0.0}
    for head_gate, opened in ((threshold, True), (0.0, False), (float(-z[flagged]) + 0.5, False)):
        settings = TiltSettings(head_gate=head_gate, **extra)
        with torch.inference_mode():
            if path == "scoring":  # log-likelihood scoring: a gate per position
                out = whole_vocabulary(head, settings, logits, pooled)
            else:
                guide = HeadGuide.uniform(head, settings, fused=path == "fused")
                out = guide(logits, pooled).clone()
        torch.testing.assert_close(out[1], logits[1])  # the head does not flag row 1's token: untouched
        assert (out[0].argmax() != flagged) == opened, (head_gate, out[0])
        if path != "scoring":
            assert float(guide.floor[0]) == (1.0 if opened else pytest.approx(float(head.forget_probability(
                pooled[:1])[0])))
            if opened:  # sticky: the next step is tilted though its likeliest token is no longer flagged
                with torch.inference_mode():
                    after = guide(logits[[1, 1]], pooled)
                assert not torch.equal(after[0], logits[1]) and torch.equal(after[1], logits[1])


def test_head_gate_is_a_non_negative_number():
    from lethe.heads.t3.guide import TiltSettings

    assert TiltSettings().head_gate == 0 and TiltSettings.from_dict({"head_gate": 2}).head_gate == 2
    for bad in (-1, True, "2", 101):
        with pytest.raises(ValueError, match="head_gate"):
            TiltSettings.from_dict({"head_gate": bad})


@pytest.mark.parametrize("lower", ["flagged", "free"])
def test_the_head_gate_reads_the_likeliest_token_alike_in_every_path_when_two_tie(lower):
    """Two tokens tie for the likeliest, one flagged by the head and one not: the kernel, the tensor operations and
    the whole-vocabulary path read the same one (the lower id, as argmax), whatever order top-k gives them."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, direction = _probed_head(3)
    pooled = (direction * 2)[None]
    z = head(pooled)[0]
    flagged_ids, free_ids = (z < -2).nonzero()[:, 0].tolist(), (z > 1).nonzero()[:, 0].tolist()
    pairs = [(f, r) for f in flagged_ids for r in free_ids if (f < r) == (lower == "flagged")]
    flagged, free = pairs[0]
    logits = torch.full((1, 40), -5.0)
    logits[0, flagged] = logits[0, free] = 5.0
    settings = TiltSettings(head_gate=1.5)
    with torch.inference_mode():
        guides = [HeadGuide.uniform(head, settings, fused=fused) for fused in (True, False)]
        scores = [guide(logits, pooled).clone() for guide in guides]
        dense = whole_vocabulary(head, settings, logits, pooled)
    opened = lower == "flagged"  # argmax's pick among the tied is the lower id
    assert [float(g.floor[0]) == 1.0 for g in guides] == [opened, opened]
    assert [torch.equal(out, logits) for out in (*scores, dense)] == [not opened] * 3


@pytest.mark.parametrize("path", ["fused", "candidates", "dense", "scoring"])
def test_flagged_mass_tilts_a_gated_row_only_where_a_flagged_token_is_likely(path):
    """flagged_mass: a row the gate lets in (a retain question after forget turns) keeps its base logits, and so
    samples what the base model samples, at a step where the tokens the head flags are unlikely; where a flagged
    token is the likeliest, it is tilted as before. The repeat guard follows the gate either way. Scoring ignores
    it: a scored option may be the unlikely flagged token, and gets the tilted score (SmolLM2's raw-form
    multiple choice ranked the gold first 0.75 of the time when scoring applied it, against 0.25)."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, direction = _probed_head(3)
    pooled = (-direction * 2)[None].repeat(2, 1)  # the probe calls both rows forget-like: the gate is open
    assert float(head.forget_probability(pooled[:1])[0]) > 0.9
    z = head(pooled)[0]
    flagged, free = int(z.argmin()), int(z.argmax())
    assert z[flagged] < 0 < z[free]
    logits = torch.full((2, 40), -5.0)
    logits[0, flagged] = 5.0  # row 0: the head flags the likeliest token
    logits[1, free], logits[1, flagged] = 5.0, 0.0  # row 1: a flagged token, but unlikely (< 0.01)
    extra = {"fused": {}, "candidates": {}, "dense": {"candidates": 0}, "scoring": {}}[path]
    for mass in (0.0, 0.1):
        settings = TiltSettings(flagged_mass=mass, **extra)
        with torch.inference_mode():
            if path == "scoring":  # log-likelihood scoring: per position
                out = whole_vocabulary(head, settings, logits, pooled)
            else:
                guide = HeadGuide.uniform(head, settings, fused=path == "fused")
                out = guide(logits, pooled).clone()
                assert guide.repeat_guards() == [settings.repeat_guard] * 2  # the gate let both rows in
        assert out[0].argmax() != flagged, (mass, out[0])  # tilted with and without the setting
        assert torch.equal(out[1], logits[1]) == (mass > 0 and path != "scoring"), (path, mass, out[1])


def test_flagged_mass_is_a_probability():
    from lethe.heads.t3.guide import TiltSettings

    assert TiltSettings().flagged_mass == 0.1 and TiltSettings.from_dict({"flagged_mass": 0.3}).flagged_mass == 0.3
    # a head's recommendation or a profile version stored while it was off by default (no key) keeps it off
    stored = {k: v for k, v in TiltSettings().as_dict().items() if k != "flagged_mass"}
    assert TiltSettings.from_dict(stored).flagged_mass == 0 and TiltSettings.from_dict({}).flagged_mass == 0
    for bad in (-0.1, 1, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="flagged_mass"):
            TiltSettings.from_dict({"flagged_mass": bad})


@pytest.mark.parametrize("path", ["fused", "candidates", "dense"])
def test_flagged_mass_counts_the_rows_own_candidates_above_its_floor_over_the_whole_vocabulary(path):
    """Rows where each part of the definition decides: (a) two candidates, one flagged: half of the candidates' mass,
    but 0.04 of the vocabulary's, and the flagged tokens outside the candidates would hold far more: untouched;
    (b) a flagged token below the row's min-p floor, 0.23 of the mass were the floor ignored: untouched; (c) a
    flagged token holding 0.6 of the mass among three candidates: tilted."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    head, direction = _probed_head(3)
    z = head(-direction * 2)  # the probe calls this state forget-like: the gate is open
    flagged, free = int(z.argmin()), int(z.argmax())
    logits = torch.full((3, 40), 1.5)
    logits[0, free] = logits[0, flagged] = 2.0
    logits[1] = -5.0
    logits[1, free], logits[1, flagged] = 5.0, 5.0 + math.log(0.3)
    logits[2] = -5.0
    logits[2, free], logits[2, flagged] = 4.0, 4.0 + math.log(1.6)
    settings = [TiltSettings(flagged_mass=0.1, candidates=2), TiltSettings(flagged_mass=0.1, min_p=0.5),
                TiltSettings(flagged_mass=0.5, candidates=3)]
    rows = [(head, s) for s in settings]
    pooled = (-direction * 2)[None].repeat(3, 1)
    if path == "dense":  # a row over the whole vocabulary sends the group down the dense path
        rows.append((head, TiltSettings(candidates=0)))
        logits, pooled = torch.cat([logits, logits[:1]]), torch.cat([pooled, pooled[:1]])
    with torch.inference_mode():
        out = HeadGuide(rows, fused=path == "fused")(logits, pooled)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[1], logits[1])
    assert not torch.equal(out[2], logits[2]) and out[2].argmax() == free


@pytest.mark.parametrize("path", ["fused", "candidates"])
def test_flagged_mass_reads_the_whole_vocabulary_where_the_candidates_alone_cannot_tell(path):
    """A flagged token holds 0.58 of the three candidates' probability; the 37 other tokens hold either much (row 0,
    each just under the third candidate's logit: the flagged token's share of the vocabulary is 0.066, under 0.1:
    untouched) or little (row 1, at -4: 0.41, over 0.1: tilted). The CPU kernel bounds the softmax's denominator by
    the likeliest tokens and sums the vocabulary only where the bounds disagree, as both rows make it."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    head, direction = _probed_head(3)
    pooled = (-direction * 2)[None].repeat(2, 1)  # the gate is open
    z = head(pooled)[0]
    flagged, free = int(z.argmin()), int(z.argmax())
    other = next(t for t in range(40) if t not in (flagged, free) and z[t] >= 0)
    logits = torch.full((2, 40), -1.01)
    logits[1] = -4.0
    for row in (0, 1):
        logits[row, flagged], logits[row, free], logits[row, other] = 0.0, -1.0, -1.0
    p = torch.softmax(logits, -1)[:, flagged]
    assert float(p[0]) < 0.1 < float(p[1])
    with torch.inference_mode():
        out = HeadGuide.uniform(head, TiltSettings(flagged_mass=0.1, candidates=3), fused=path == "fused")(logits,
                                                                                                         pooled)
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out[1], logits[1]) and out[1].argmax() != flagged


@pytest.mark.parametrize("path", ["fused", "candidates", "dense", "scoring"])
def test_the_word_guard_lets_no_piece_continue_the_word_where_the_head_flags_the_next_word(path):
    """The demo's fragments ("Dredrou" + "g" + "p" + "binary"): the head flags the base model's next word, the cap puts
    it below the best other candidate, and that was a piece continuing the current word. With the word guard, at such
    a step, the pieces that would continue the word are dropped, so the next best word is chosen instead; a step whose
    likeliest token the head does not flag, or whose likeliest token itself continues the word, keeps every candidate.
    Scoring keeps every token (a decoding truncation, like min-p, would give a scored text no probability)."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, direction = _probed_head(3)
    pooled = (-direction * 2)[None].repeat(5, 1)  # the probe calls every row forget-like: the gate is open
    z = head(pooled)[0]
    order = z.argsort(descending=True)
    flagged, piece, word, other_piece = int(z.argmin()), int(order[0]), int(order[1]), int(order[2])
    assert z[flagged] < 0 < z[word] and z[piece] > 0 and z[other_piece] > 0
    words = torch.zeros(40, dtype=torch.bool)
    words[[piece, other_piece]] = True  # the pieces that continue a word; `flagged` and `word` start one
    logits = torch.full((5, 40), -5.0)
    logits[:, piece], logits[:, word] = 3.0, 1.0
    logits[0, flagged] = 5.0  # row 0: the head flags the likeliest token, which starts a word: guarded
    logits[1, word] = 6.0  # row 1: the likeliest token is not flagged: every candidate kept
    logits[2, other_piece] = 5.0  # row 2: the likeliest token continues the word itself: every candidate kept
    logits[3, flagged] = 5.0  # row 3: as row 0, with the guard off
    # row 4: as row 0, but its min-p floor leaves no unflagged candidate besides the piece: the guard keeps it, so the
    # cap still holds the flagged token under it (dropping it would leave the flagged token uncapped, on top)
    logits[4, flagged], logits[4, word] = 5.0, -5.0
    extra = {"fused": {}, "candidates": {}, "dense": {"candidates": 0}, "scoring": {}}[path]
    settings = [TiltSettings(**extra)] * 3 + [TiltSettings(word_guard=False, **extra), TiltSettings(min_p=0.01, **extra)]
    with torch.inference_mode():
        if path == "scoring":
            out = torch.cat([whole_vocabulary(head, s, logits[i:i + 1], pooled[i:i + 1])
                             for i, s in enumerate(settings)])
        else:
            out = HeadGuide([(head, s) for s in settings], fused=path == "fused", words=words)(logits, pooled).clone()
            with torch.inference_mode():  # a guide the decode loop has not handed the tokenizer's words: no guard
                unguarded = HeadGuide([(head, settings[0])], fused=path == "fused")(logits[:1], pooled[:1])
            assert int(unguarded[0].argmax()) == piece
    guarded = path != "scoring"
    assert int(out[0].argmax()) == (word if guarded else piece), out[0]
    assert torch.isfinite(out[0, piece]) != guarded and torch.isfinite(out[0, flagged])
    assert int(out[1].argmax()) == word and torch.isfinite(out[1, piece])
    assert torch.isfinite(out[2, piece]) and torch.isfinite(out[2, other_piece])
    assert int(out[3].argmax()) == piece
    assert int(out[4].argmax()) == piece and torch.isfinite(out[4, flagged])


def test_word_guard_is_a_boolean_setting_off_in_the_paper_preset_and_in_settings_stored_before_it():
    from lethe.heads.t3.guide import PRESETS, TiltSettings

    assert TiltSettings().word_guard and not PRESETS["paper"].word_guard
    # a profile version or a head's recommendation written before the guard existed serves as it did then
    assert not TiltSettings.from_dict({"T": 2.0, "sticky_gate": False}).word_guard
    assert TiltSettings.from_dict(TiltSettings().as_dict()).word_guard
    with pytest.raises(ValueError, match="word_guard: must be true or false"):
        TiltSettings.from_dict({"word_guard": "yes"})


@pytest.mark.parametrize("batch", [1, 6, 12])
def test_cpu_kernel_equals_the_tensor_operations_with_the_word_guard(batch):
    from lethe.heads.t3.guide import HeadGuide, TiltSettings

    head, _ = _probed_head(batch)
    torch.manual_seed(batch)
    words = torch.rand(40) < 0.4
    choices = [TiltSettings(), TiltSettings(word_guard=False), TiltSettings(T=2.0, candidates=7, min_p=0.05),
               TiltSettings(head_gate=1.0, cap=1.0), TiltSettings(flagged_mass=0.2)]
    rows = [(head, choices[i % len(choices)]) for i in range(batch)]
    logits, pooled = torch.randn(batch, 40) * 4, torch.randn(batch, 8) * 2
    with torch.inference_mode():
        kernel = HeadGuide(rows, fused=True, words=words)(logits, pooled)
        tensor_ops = HeadGuide(rows, fused=False, words=words)(logits, pooled)
        unguarded = HeadGuide(rows, fused=False)(logits, pooled)
    assert torch.equal(torch.isfinite(kernel), torch.isfinite(tensor_ops))
    assert not torch.equal(torch.isfinite(tensor_ops), torch.isfinite(unguarded))  # the guard dropped some pieces
    torch.testing.assert_close(torch.softmax(kernel, -1), torch.softmax(tensor_ops, -1), atol=1e-5, rtol=1e-4)
    assert torch.equal(kernel.argmax(-1), tensor_ops.argmax(-1))


def test_max_push_is_a_number_or_null_off_by_default():
    from lethe.heads.t3.guide import PRESETS, TiltSettings

    assert TiltSettings().max_push is None and PRESETS["paper"].max_push is None
    assert TiltSettings.from_dict({"T": 2.0, "word_guard": True}).max_push is None
    assert TiltSettings.from_dict({"max_push": 2}).max_push == 2
    assert TiltSettings.from_dict(TiltSettings(max_push=4.0).as_dict()).max_push == 4.0
    for bad in (-1, 101, "4", True):
        with pytest.raises(ValueError, match="max_push: must be a number in"):
            TiltSettings.from_dict({"max_push": bad})


def test_scoring_applies_the_push_limit_as_decoding_does():
    """Echo log-probabilities and `lethe eval` (`whole_vocabulary`) hold a forgotten answer's token no further below
    the best other token than the limit allows, the same score a decoding step gives it among the candidates."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, _ = _probed_head(3)
    torch.nn.init.normal_(head.up.weight, std=20.0)  # pushes of many nats
    logits, pooled = torch.randn(3, 40) * 4, torch.randn(3, 8) * 2
    settings = TiltSettings(gate=False, candidates=40, flagged_mass=0.0, max_push=4.0)
    with torch.inference_mode():
        raw = whole_vocabulary(head, settings, logits, pooled)
        unlimited = whole_vocabulary(head, dataclasses.replace(settings, max_push=None), logits, pooled)
        for fused in (True, False):
            decoded = torch.log_softmax(HeadGuide.uniform(head, settings, fused=fused)(logits, pooled), -1)
            torch.testing.assert_close(decoded, torch.log_softmax(raw, -1), atol=1e-4, rtol=1e-4)
        z = head(pooled)
    flagged = z < 0
    free = raw.masked_fill(flagged, float("-inf")).amax(-1, keepdim=True)
    floor = torch.minimum(torch.log_softmax(logits, -1), free - 0.5) - 4.0
    assert bool((raw[flagged] >= floor[flagged] - 1e-4).all())
    assert float((raw - unlimited)[flagged].max()) > 1.0  # the limit acted: some flagged token was raised


def test_the_push_limit_needs_the_cap():
    """`max_push` with the cap off changes no score, in scoring and in decoding."""
    import dataclasses as dc

    from lethe.heads.t3.guide import HeadGuide, TiltSettings, whole_vocabulary

    head, _ = _probed_head(4)
    logits, pooled = torch.randn(3, 40) * 4, torch.randn(3, 8) * 2
    plain = TiltSettings(gate=False, cap=None, flagged_mass=0.0)
    limited = dc.replace(plain, max_push=1.0)
    with torch.inference_mode():
        scored = whole_vocabulary(head, limited, logits, pooled)
        assert torch.equal(scored, whole_vocabulary(head, plain, logits, pooled))
        for fused in (True, False):
            assert torch.equal(HeadGuide.uniform(head, limited, fused=fused)(logits, pooled).clone(),
                               HeadGuide.uniform(head, plain, fused=fused)(logits, pooled).clone())
