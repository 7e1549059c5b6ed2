"""ASU's presets (heads/asu/presets.py): what a job or `lethe asu train` distils with where it is not told."""

import pytest

from lethe.heads.asu.presets import after_teacher, before_teacher, preset_of


def test_the_default_preset_is_the_recipe_measured_best_and_minimal_is_the_release_before():
    lethe = before_teacher("lethe", {})
    assert (lethe.retain_loss, lethe.retain_weight, lethe.steps, lethe.own_answers, lethe.retain_own_answers) == \
        ("kl", 5.0, 100, True, True)
    minimal = before_teacher("minimal", {})
    assert (minimal.retain_loss, minimal.retain_weight, minimal.steps, minimal.own_answers,
            minimal.retain_own_answers, minimal.gate, minimal.lora_layers) == ("gd", 1.0, 300, False, False, False,
                                                                               None)


def test_a_given_setting_wins_and_retain_own_answers_follows_the_retain_loss():
    cfg = before_teacher("lethe", {"steps": 7, "own_answers": False, "retain_weight": None, "retain_loss": "gd"})
    assert (cfg.steps, cfg.own_answers, cfg.retain_weight, cfg.retain_loss) == (7, False, 5.0, "gd")
    assert cfg.retain_own_answers is False, "gd with the model's own retain answers would teach them"
    assert before_teacher("minimal", {"retain_loss": "kl"}).retain_own_answers is False  # minimal: off anyway
    # own answers by default fall back to the set's answers where the model states none of the facts; asked, not
    assert before_teacher("lethe", {}).own_answers_fallback is True
    assert before_teacher("lethe", {"own_answers": True}).own_answers_fallback is False
    assert before_teacher("minimal", {}).own_answers_fallback is False
    with pytest.raises(ValueError, match="preset"):
        before_teacher("best", {})
    with pytest.raises(ValueError, match="temperature"):
        before_teacher("lethe", {"temperature": 2})


@pytest.mark.parametrize("tempered, given, lora_layers, gate", [
    ("20-29", {}, "20-29", True),  # SmolLM2's pick: adapters where the teacher tempers, gated
    (None, {}, None, False),  # every layer tempered: adapters everywhere, no gate (it would read the embeddings)
    ("0-29", {}, None, False),
    ("0-9", {}, "0-9", False),  # adapters from the first layer: no gate either
    ("20-29", {"lora_layers": "25-29"}, "25-29", True),
    ("20-29", {"gate": False}, "20-29", False),
    ("0-9", {"lora_layers": "5-9", "gate": None}, "5-9", True),
])
def test_the_lethe_preset_puts_the_adapters_in_the_tempered_layers_and_gates_them_past_the_first(
        tempered, given, lora_layers, gate):
    cfg = before_teacher("lethe", given)
    cfg.layers = tempered
    cfg = after_teacher("lethe", given, cfg, num_layers=30)
    assert (cfg.lora_layers, cfg.gate) == (lora_layers, gate)


def test_minimal_and_full_layers_keep_what_they_were_given():
    cfg = before_teacher("minimal", {})
    cfg.layers = "20-29"
    assert (after_teacher("minimal", {}, cfg, 30).lora_layers, cfg.gate) == (None, False)
    full = before_teacher("lethe", {"full_layers": "1"})
    full.layers = "20-29"
    assert (after_teacher("lethe", {"full_layers": "1"}, full, 30).lora_layers, full.gate) == (None, False)


def test_the_gate_defaults_to_off_where_the_engine_cannot_serve_it():
    cfg = before_teacher("lethe", {})
    cfg.layers = "20-29"
    cfg = after_teacher("lethe", {}, cfg, 30, gate_servable=False)
    assert (cfg.lora_layers, cfg.gate) == ("20-29", False)


def test_a_job_queued_before_presets_keeps_the_defaults_of_its_day():
    assert preset_of({"tau": None, "steps": 300, "retain_loss": "gd"}) == "minimal"
    assert preset_of({"preset": "lethe"}) == "lethe" and preset_of({"preset": "minimal"}) == "minimal"


@pytest.mark.parametrize("pick, retain_loss, steps, lora_layers, gate, settings_from", [
    ({"tau": 8.0, "layers": "20-29"}, "kl", 100, "20-29", True, None),  # the pick: the lethe recipe on it
    (None, "gd", 300, None, False, "minimal"),  # no pick: tau 16 with the release before's settings, all of them
])
def test_without_a_pick_of_the_teacher_the_settings_not_given_are_the_minimal_presets(
        monkeypatch, pick, retain_loss, steps, lora_layers, gate, settings_from):
    """The lethe recipe rests on the teacher's pick; where there is none (the demo: nothing flips enough of the
    facts) the job falls back to tau 16 and the release before's settings, which forgot more there."""
    from types import SimpleNamespace

    from lethe.heads.asu import presets, teacher

    def choose(lm, forget, layers, fmt, on_progress=None, memo=None):
        if pick is None:
            return 16.0, layers, {"pick": None, "reason": "no candidate flips enough of the facts"}
        return pick["tau"], pick["layers"], {"pick": pick, "reason": "the diagnostic's pick"}

    monkeypatch.setattr(teacher, "choose_teacher", choose)
    lm = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30)))
    cfg, report = presets.configure(lm, [], {"steps": None, "seed": 3})
    assert (cfg.retain_loss, cfg.steps, cfg.lora_layers, cfg.gate, cfg.seed) == (retain_loss, steps, lora_layers,
                                                                                 gate, 3)
    assert cfg.tau == (pick or {"tau": 16.0})["tau"]
    info = presets.record(SimpleNamespace(training={}, metrics={}), "lethe", report)  # what the weights say
    assert (info.training["preset"], info.training.get("settings_from"), info.metrics["teacher"]) == \
        ("lethe", settings_from, report)
    # a given setting still wins without a pick
    assert presets.configure(lm, [], {"retain_loss": "kl"})[0].retain_loss == "kl"
