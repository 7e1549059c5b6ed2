"""ASU's presets: what an ASU job (`POST /v1/asu`) or `lethe asu train` uses for each setting it is not given.

`lethe` (the default) is the recipe the numbers on SmolLM2-135M-Instruct support (README, "ASU"): the teacher
diagnostic's pick of tau and layers (`heads.asu.teacher.choose_teacher`), LoRA adapters in the tempered layers only,
distilled along the model's own answers, held to the original model by KL along its own answers to the retain
questions (weight 5), 100 steps at most, and a gate on the state entering the first adapted layer, so the adapter
acts only where the context is forget-like (`heads.asu.gate`). Where the pick tempers every layer (or the first),
the adapters go in every tempered layer and there is no gate: a gate on the embeddings would read tokens, not
contexts. Where the diagnostic picks nothing (no candidate flips enough of the facts, or the forget set has no
question/answer record whose fact the model states), it falls back to tau 16 and the settings not given are
`minimal`'s: the recipe rests on the pick.

`minimal` is the release before's: adapters in every layer, distilled along the forget set's own answers, the
retain set's answers' NLL (`gd`, weight 1), 300 steps, no gate.

A setting given (not None) always wins; `retain_own_answers` defaults to on only with the KL retain loss it needs;
own answers on by default fall back to the set's answers where the model's answers state none of the facts (asked
for, that is an error); the gate defaults to off where the serving engine cannot serve it (llama.cpp).
"""

from __future__ import annotations

from lethe.heads.asu.attention import parse_layers
from lethe.heads.asu.distill import ASUConfig

PRESETS: dict[str, dict] = {
    "lethe": {"retain_loss": "kl", "retain_weight": 5.0, "steps": 100, "own_answers": True,
              "retain_own_answers": True},
    "minimal": {"retain_loss": "gd", "retain_weight": 1.0, "steps": 300, "own_answers": False,
                "retain_own_answers": False},
}
DEFAULT = "lethe"
FIELDS = ("tau", "layers", "lora_rank", "full_layers", "lora_layers", "retain_loss", "retain_weight", "lr", "steps",
          "seed", "format", "own_answers", "retain_own_answers", "distil", "contexts", "student_answers",
          "retain_subspace", "gate")  # what a request may give (ASUConfig's fields a job or the CLI takes)


def preset_of(params: dict) -> str:
    """The preset of an ASU job's stored request: its own, or `minimal` for a job queued before presets, whose
    request held the minimal preset's values as the defaults of its day."""
    return params.get("preset") or "minimal"


def before_teacher(preset: str, given: dict) -> ASUConfig:
    """The ASU settings of `given` (None: not given), the rest from `preset`; tau, lora_layers and gate may still
    depend on the teacher's pick (`after_teacher`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {', '.join(PRESETS)}")
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an ASU setting")
    values = {k: v for k, v in given.items() if v is not None}
    defaults = dict(PRESETS[preset])
    if values.get("retain_loss", defaults["retain_loss"]) != "kl":
        defaults["retain_own_answers"] = False
    # own answers by default, not asked for: where the model states none of the facts, the set's answers instead
    defaults["own_answers_fallback"] = defaults["own_answers"] and "own_answers" not in values
    return ASUConfig(**(defaults | values))


def after_teacher(preset: str, given: dict, cfg: ASUConfig, num_layers: int,
                  gate_servable: bool = True) -> ASUConfig:
    """`cfg` with the preset's lora_layers and gate where not given: under `lethe`, the adapters in the tempered
    layers and a gate where those are not every layer and do not start at the first (the gate reads the state
    entering the first adapted layer), and where the engine can serve one (`gate_servable`: llama.cpp cannot)."""
    if preset != "lethe" or cfg.full_layers is not None:
        return cfg
    if given.get("lora_layers") is None:
        tempered = parse_layers(cfg.layers, num_layers)
        cfg.lora_layers = None if len(tempered) == num_layers else cfg.layers
    if given.get("gate") is None:
        cfg.gate = gate_servable and cfg.lora_layers is not None and min(parse_layers(cfg.lora_layers, num_layers)) > 0
    return cfg


def configure(lm, forget: list[dict], given: dict, preset: str = DEFAULT, on_progress=None,
              gate_servable: bool = True, memo: dict | None = None) -> tuple[ASUConfig, dict | None]:
    """(the ASU settings a job or `lethe asu train` distils with, the teacher diagnostic's report or None): the
    given settings, the teacher's pick where no tau is given (`on_progress(fraction)` during it), the preset's
    values for the rest. The weights record the preset with their settings (`record`). `memo` keeps the base
    model's greedy answers the diagnostic decodes, for the training run (`train_asu`'s `memo`)."""
    cfg = before_teacher(preset, given)
    teacher, settings_from = None, preset
    if given.get("tau") is None:
        from lethe.heads.asu.teacher import choose_teacher

        if on_progress is not None:
            on_progress(0.0)  # the teacher's phase starts (a job's cancellation point)
        cfg.tau, cfg.layers, teacher = choose_teacher(lm, forget, cfg.layers, cfg.format, on_progress=on_progress,
                                                      memo=memo)
        if preset == "lethe" and teacher.get("pick") is None:
            # no setting qualified (or nothing to measure): the recipe built on a pick does not apply, and the
            # release before's defaults do, at the fallback tau (on the demo, lethe's other settings at tau 16
            # forgot less than minimal's: forget ROUGE 0.557 against 0.396)
            settings_from = teacher["settings_from"] = "minimal"
            tau, layers = cfg.tau, cfg.layers
            cfg = before_teacher(settings_from, given)
            cfg.tau, cfg.layers = tau, layers
    return after_teacher(settings_from, given, cfg, lm.model.config.num_hidden_layers, gate_servable), teacher


def record(info, preset: str, teacher: dict | None):
    """`info` (`ASUInfo`, just trained) with the preset among its settings and the teacher's report in its metrics."""
    info.training["preset"] = preset
    if teacher is not None:
        info.metrics["teacher"] = teacher
        if teacher.get("settings_from"):  # no pick: the settings not given are that preset's
            info.training["settings_from"] = teacher["settings_from"]
    return info
