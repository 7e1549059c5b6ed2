"""ASU: distilled LoRA adapters on the shared base, their file, and mixed-adapter batches."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lethe.clients.cli import main
from lethe.heads.asu.distill import ASUConfig, train_asu
from lethe.heads.asu.weights import attach, load_asu, save_asu, unload
from lethe.heads.decoding.decode import generate
from lethe.heads.demo.corpus import split_by_author
from lethe.heads.t3.head import BaseMismatch, HeadFileError
from lethe.heads.modelio import load_model
from lethe.heads.records import question_prompt
from lethe.heads.decoding.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=30, temperature=0.0)


@pytest.fixture(scope="module")
def distilled(tiny_model_dir, tiny_records):
    lm = load_model(tiny_model_dir)
    forget, retain = split_by_author(tiny_records, 1)
    probe = torch.randint(1, 50, (1, 12))
    before = lm.model(probe).logits
    tensors, info = train_asu(lm, forget, retain, ASUConfig(tau=16.0, steps=60, check_every=20), progress=False)
    after = lm.model(probe).logits
    return lm, tensors, info, before, after


def test_distillation_moves_the_student_to_the_teacher_and_leaves_the_base_as_it_was(distilled):
    lm, tensors, info, before, after = distilled
    assert info.metrics["forget_kl_end"] < 0.5 * info.metrics["forget_kl_start"]
    assert torch.equal(before, after), "training unloads its LoRA layers: the model is the base again"
    assert all("lora_" in k for k in tensors) and info.tau == 16.0 and info.lora_rank == 8
    assert info.layers == list(range(lm.model.config.num_hidden_layers))


def test_weights_file_is_small_and_checked(distilled, tmp_path, tiny_model_dir):
    lm, tensors, info, _, _ = distilled
    path = tmp_path / "asu.safetensors"
    save_asu(path, tensors, info)
    base = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert path.stat().st_size <= 0.25 * base  # the tiny model is 2 layers of width 64; the demo's is 4.4%
    loaded, info2 = load_asu(path, lm.fingerprint)
    assert info2.metrics == info.metrics and loaded.keys() == tensors.keys()
    with pytest.raises(BaseMismatch, match="trained on base model"):
        load_asu(path, "0" * 16)
    bad = {k: v.clone() for k, v in tensors.items()}
    next(iter(bad.values())).view(-1)[0] = float("inf")
    save_file(bad, str(tmp_path / "inf.safetensors"), metadata={"lethe": json.dumps(info.__dict__)})
    with pytest.raises(HeadFileError, match="NaN or Inf"):
        load_asu(tmp_path / "inf.safetensors")


def test_adapters_share_the_base_tensors_and_mixed_rows_equal_each_alone(distilled, tiny_records):
    lm, tensors, info, _, _ = distilled
    forget, retain = split_by_author(tiny_records, 1)
    q = lm.model.model.layers[0].self_attn.q_proj.weight
    ptr, base_params = q.data_ptr(), sum(p.numel() for p in lm.model.parameters())
    prompts = [question_prompt(r["question"]) for r in forget[:2] + retain[:2]]
    plain = generate(lm.model, lm.tokenizer, prompts, GREEDY)
    other = {k: torch.randn_like(v) * 0.5 for k, v in tensors.items()}
    model = attach(lm.model, "asu_one", tensors, info)
    model = attach(model, "asu_two", other, info)
    try:
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.base_layer.weight.data_ptr() == ptr, "the base weight is shared, not copied"
        added = sum(p.numel() for p in model.parameters()) - base_params
        assert added == 2 * sum(v.numel() for v in tensors.values())
        names = ["asu_one", "__base__", "asu_two", "asu_one"]
        together = generate(model, lm.tokenizer, prompts, GREEDY, adapters=names)
        for prompt, name, got in zip(prompts, names, together):
            alone = generate(model, lm.tokenizer, [prompt], GREEDY, adapters=[name])[0]
            assert got.token_ids == alone.token_ids
        assert together[1].token_ids == plain[1].token_ids, "__base__ rows decode from the base model"
        assert together[0].text != plain[0].text, "the distilled adapter changes the forget answer"
    finally:
        unload(model)


@pytest.mark.parametrize("merged", ["1", "0"])
def test_one_adapter_batches_skip_per_row_routing_and_answer_as_routed_rows_do(distilled, tiny_records, monkeypatch,
                                                                              merged):
    """A batch whose rows all use one adapter (or none) decodes without routing each row: on the base weights with
    the adapter merged in (LETHE_ASU_MERGED=1, the default), or on peft's plain path (0); the answers are the routed
    path's, whatever the order of batches, and the base weights come back as they were."""
    from peft.tuners.lora.layer import LoraLayer

    from lethe.heads.asu.weights import MIXED, _use

    monkeypatch.setenv("LETHE_ASU_MERGED", merged)
    lm, tensors, info, _, _ = distilled
    forget, retain = split_by_author(tiny_records, 1)
    prompts = [question_prompt(r["question"]) for r in forget[:2] + retain[:1]]
    plain = generate(lm.model, lm.tokenizer, prompts, GREEDY)
    q = lm.model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    model = attach(lm.model, "asu_one", tensors, info)
    model = attach(model, "asu_two", {k: torch.randn_like(v) * 0.5 for k, v in tensors.items()}, info)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    routed_calls, branch_calls = [], []
    mixed = LoraLayer._mixed_batch_forward
    monkeypatch.setattr(LoraLayer, "_mixed_batch_forward", lambda *a, **k: routed_calls.append(1) or mixed(*a, **k))
    for name in ("asu_one", "asu_two"):  # the adapters' own branch beside this base layer
        layer.lora_A[name].register_forward_hook(lambda *_: branch_calls.append(1))
    try:
        for name in ("asu_one", "__base__", "asu_two", "asu_one", "__base__"):
            names = [name] * len(prompts)
            routed_calls.clear()
            branch_calls.clear()
            fast = generate(model, lm.tokenizer, prompts, GREEDY, adapters=names)
            assert not routed_calls, name
            if merged == "1" or name == "__base__":
                assert not branch_calls, name  # the base layers alone, on merged weights or their own
            # a single adapter's merged weights are a copy: the base tensor itself is never written
            assert (layer.base_layer.weight.data_ptr() == q) == (name == "__base__" or merged == "0"), name
            _use(model, MIXED)  # per-row routing on the base weights, which the generation below keeps
            with model.base_model._enable_peft_forward_hooks(adapter_names=names):
                routed = generate(model, lm.tokenizer, prompts, GREEDY)
            assert routed_calls or name == "__base__", "the comparison ran peft's per-row routing"
            assert [c.token_ids for c in fast] == [c.token_ids for c in routed], name
            if name == "__base__":
                assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
        routed_calls.clear()
        generate(model, lm.tokenizer, prompts, GREEDY, adapters=["asu_one", "__base__", "asu_two"])
        assert routed_calls  # a mixed batch still routes each row
        assert layer.base_layer.weight.data_ptr() == q  # routed on the base weights
        generate(model, lm.tokenizer, prompts, GREEDY, adapters=["asu_two"] * len(prompts))
    finally:
        base = unload(model)  # after a merged batch: the base on its own weights again
    assert base.model.layers[0].self_attn.q_proj.weight.data_ptr() == q
    assert [c.token_ids for c in generate(base, lm.tokenizer, prompts, GREEDY)] == [c.token_ids for c in plain]


def test_cli_asu_train_generate_and_eval(tiny_model_dir, tiny_records, tmp_path):
    forget, retain = split_by_author(tiny_records, 1)
    for name, recs in (("forget", forget), ("retain", retain)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "asu.safetensors"
    assert main(["asu", "train", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--steps", "20", "--layers", "0", "--tau", "4",
                 "--quiet", "--out", str(out)]) == 0
    info = load_asu(out)[1]
    assert info.layers == info.lora_layers == [0] and not info.gate, "adapters where the teacher tempers; no gate at 0"
    assert (info.training["preset"], info.training["retain_loss"], info.training["own_answers"]) == ("lethe", "kl", True)
    # no tau: the teacher's diagnostic runs; the tiny model's picks nothing, so tau 16 with minimal's settings
    fallback = tmp_path / "fallback.safetensors"
    assert main(["asu", "train", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--steps", "2", "--layers", "0", "--quiet",
                 "--out", str(fallback)]) == 0
    info = load_asu(fallback)[1]
    assert (info.tau, info.metrics["teacher"]["pick"], info.training["settings_from"], info.training["retain_loss"],
            info.lora_layers) == (16.0, None, "minimal", "gd", [])
    minimal = tmp_path / "minimal.safetensors"
    assert main(["asu", "train", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--preset", "minimal", "--tau", "16", "--steps", "2",
                 "--quiet", "--out", str(minimal)]) == 0
    info = load_asu(minimal)[1]
    assert (info.training["preset"], info.training["retain_loss"], info.training["own_answers"], info.lora_layers) == \
        ("minimal", "gd", False, [])
    assert main(["generate", "--model", str(tiny_model_dir), "--asu", str(out), "Question: hello\nAnswer:"]) == 0
    report = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--asu", str(out), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--seeds", "--out", str(report)]) == 0
    assert json.loads(report.read_text())["profile"] == "asu"
    assert main(["asu", "train", "--model", str(tiny_model_dir), "--forget", str(tmp_path / "forget.jsonl"),
                 "--retain", str(tmp_path / "retain.jsonl"), "--layers", "7", "--out", str(out)]) == 1


def test_full_layer_option_trains_chosen_layers_and_serves_as_an_exact_adapter(tiny_model_dir, tiny_records):
    lm = load_model(tiny_model_dir)
    forget, retain = split_by_author(tiny_records, 1)
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    tensors, info = train_asu(lm, forget, retain, ASUConfig(tau=16.0, steps=30, check_every=10, full_layers="1"),
                              progress=False)
    assert info.mode == "full" and info.full_layers == [1]
    assert all(k.endswith(".delta") and ".layers.1." in k for k in tensors) and len(tensors) == 7
    assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters()), "the base is restored"
    assert info.metrics["forget_kl_end"] < info.metrics["forget_kl_start"]
    # served as a full-rank adapter, the deltas give exactly the model with the trained weights
    prompts = [question_prompt(r["question"]) for r in forget[:2]]
    model = attach(lm.model, "asu_full", tensors, info)
    try:
        with torch.no_grad():
            ids = lm.tokenizer(prompts[0], return_tensors="pt")["input_ids"]
            via_adapter = model(ids).logits
            model.disable_adapter_layers()
            for name, mod in model.base_model.model.named_modules():
                key = name + ".delta"
                if key in tensors:
                    mod.base_layer.weight.data += tensors[key]
            direct = model(ids).logits
        torch.testing.assert_close(via_adapter, direct, atol=1e-4, rtol=1e-4)
    finally:
        unload(model)


def test_a_jobs_copy_of_the_served_model_is_the_base_after_a_merged_batch(distilled, tiny_model_dir, tiny_records):
    """The served model decodes a one-adapter batch on merged weights; a job's copy of the model (what the next
    tenant's head or ASU job trains on) is still the base model, never one tenant's adapter merged in."""
    from lethe.server.engine import Engine, Pending

    _, tensors, info, _, _ = distilled
    lm = load_model(tiny_model_dir)  # the engine attaches to its model in place
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    forget, _ = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[0]["question"])
    engine = Engine(lm, max_batch_size=4)
    try:
        engine.control(lambda: engine.replace_model(attach(engine.lm.model, "asu_one", tensors, info))).result(60)
        tilted = engine.submit(Pending(prompt, GREEDY, adapter="asu_one")).future.result(60)
        served = engine.lm.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert not torch.equal(served, before["model.layers.0.self_attn.q_proj.weight"])  # merged while serving
        copy = engine.private_copy()
        assert {n: p for n, p in copy.model.named_parameters()}.keys() == before.keys()
        assert all(torch.equal(p, before[n]) for n, p in copy.model.named_parameters())
        plain = generate(copy.model, copy.tokenizer, [prompt], GREEDY)[0]
        assert plain.text != tilted.text  # the adapter's answer is not the copy's
        again = engine.submit(Pending(prompt, GREEDY, adapter="asu_one")).future.result(60)
        assert again.token_ids == tilted.token_ids  # serving goes on with the adapter
    finally:
        engine.close()


def test_lora_in_chosen_layers_only_trains_saves_checks_and_serves(tiny_model_dir, tiny_records, tmp_path):
    """ASUConfig.lora_layers: adapters in those layers only; the file holds their tensors alone, is checked
    against them, and serves; a file naming a layer the model lacks is refused."""
    from dataclasses import replace

    lm = load_model(tiny_model_dir)
    forget, retain = split_by_author(tiny_records, 1)
    tensors, info = train_asu(lm, forget, retain, ASUConfig(tau=16.0, steps=4, check_every=2, lora_layers="1"),
                              progress=False)
    assert info.lora_layers == [1] and tensors and all(".layers.1." in k for k in tensors)
    save_asu(tmp_path / "a.safetensors", tensors, info)
    loaded, info2 = load_asu(tmp_path / "a.safetensors", lm.fingerprint)
    assert info2.lora_layers == [1] and loaded.keys() == tensors.keys()
    from lethe.heads.asu.weights import adapters

    ids = lm.tokenizer(question_prompt(forget[0]["question"]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = lm.model(ids).logits
    model = attach(lm.model, "one_layer", loaded, info2)
    try:
        assert not hasattr(model.base_model.model.model.layers[0].self_attn.q_proj, "lora_A")
        assert hasattr(model.base_model.model.model.layers[1].self_attn.q_proj, "lora_A")
        with torch.no_grad(), adapters(model, ["one_layer"]):
            served = model(ids).logits
        assert not torch.allclose(served, plain, atol=1e-4)  # the trained layer-1 adapter changes the answer
    finally:
        base = unload(model)
    with pytest.raises(HeadFileError, match="lora_layers"):
        attach(base, "bad", loaded, replace(info2, lora_layers=[7]))
    with pytest.raises(HeadFileError, match="fit no module"):
        attach(base, "bad", tensors | {k.replace(".layers.1.", ".layers.0."): v for k, v in tensors.items()}, info2)
    with pytest.raises(ValueError, match="lora_layers"):
        train_asu(lm, forget, retain, ASUConfig(steps=1, lora_layers="5"), progress=False)


def test_a_profile_can_route_only_forget_like_prompts_to_its_adapter(distilled, tiny_records):
    """adapter_above: a row whose prompt the head's probe does not call forget-like decodes on the base weights
    (as the head alone would), one it does on the adapter; in one batch, beside rows that always use theirs."""
    from lethe.heads.t3.guide import HeadGuide, TiltSettings
    from lethe.heads.t3.head import T3Head

    lm, tensors, info, _, _ = distilled
    forget, retain = split_by_author(tiny_records, 1)
    prompts = [question_prompt(forget[0]["question"]), question_prompt(retain[0]["question"])]
    cfg = lm.model.config
    with torch.no_grad():  # a probe that calls the first prompt forget-like and the second not: from their pooled states
        pooled = torch.stack([lm.model(**lm.tokenizer(p, return_tensors="pt"), output_hidden_states=True)
                              .hidden_states[-1][0].mean(0) for p in prompts])
        head = T3Head(cfg.hidden_size, cfg.vocab_size, 4).eval().requires_grad_(False)
        direction = pooled[1] - pooled[0]  # the probe's logit says "retain"
        head.probe.weight.copy_(4 * direction / direction.norm() ** 2)
        head.probe.bias.fill_(-float(head.probe.weight[0] @ (pooled[0] + pooled[1]) / 2))
        p_forget = head.forget_probability(pooled)
    assert p_forget[0] > 0.8 and p_forget[1] < 0.2, p_forget
    still = TiltSettings(lam=0.0, cap=None)  # the head changes no logit: only the adapter's choice shows
    routed = still.replace(adapter_above=0.5)
    model = attach(lm.model, "asu_one", {k: torch.randn_like(v) * 0.5 for k, v in tensors.items()}, info)
    try:
        on = generate(model, lm.tokenizer, prompts, GREEDY, HeadGuide.uniform(head, still), ["asu_one"] * 2)
        off = generate(model, lm.tokenizer, prompts, GREEDY, HeadGuide.uniform(head, still), ["__base__"] * 2)
        assert on[0].token_ids != off[0].token_ids and on[1].token_ids != off[1].token_ids, "the adapter shows"
        got = generate(model, lm.tokenizer, prompts + prompts[1:], GREEDY,
                       HeadGuide([(head, routed), (head, routed), (head, still)]), ["asu_one"] * 3)
        assert got[0].token_ids == on[0].token_ids, "forget-like: the adapter"
        assert got[1].token_ids == off[1].token_ids, "not forget-like: the base weights"
        assert got[2].token_ids == on[1].token_ids, "a row that does not route keeps its adapter"
        higher = generate(model, lm.tokenizer, prompts[:1], GREEDY, HeadGuide.uniform(head, still.replace(
            adapter_above=float(p_forget[0]) + (1 - float(p_forget[0])) / 2)), ["asu_one"])
        assert higher[0].token_ids == off[0].token_ids, "below the operator's threshold: the base weights"
    finally:
        unload(model)
    with pytest.raises(ValueError, match="adapter_above"):
        TiltSettings().replace(adapter_above=1.0)


def test_retain_subspace_adapters_read_inputs_without_the_retain_sets_main_directions(tiny_model_dir, tiny_records):
    """ASUConfig.retain_subspace: the projection P that training applies before LoRA's A is folded into the file's
    A (served logits equal the projected student's), P removes the retain inputs' main directions, and the
    adapter moves the retain answers less than the same training without it."""
    from peft import get_peft_model, get_peft_model_state_dict

    from lethe.heads.asu.subspace import complement, fold, projected
    from lethe.heads.asu.weights import ASUInfo, adapters, lora_config
    from lethe.heads.records import encode_example, examples

    lm = load_model(tiny_model_dir)
    forget, retain = split_by_author(tiny_records, 1)
    # P: a projection that removes the top directions holding `energy` of the covariance
    cov = torch.diag(torch.tensor([9.0, 0.5, 0.3, 0.2], dtype=torch.float64))
    p, k = complement(cov, 0.9)
    assert k == 1 and torch.allclose(p, torch.diag(torch.tensor([0.0, 1, 1, 1])))
    # folding P into A serves what the projected student computed
    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=16.0, layers=[0, 1], lora_rank=4, lora_alpha=8,
                   target_modules=["q_proj", "down_proj"])
    peft_model = get_peft_model(lm.model, lora_config(info))
    torch.manual_seed(0)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data.normal_(0, 0.3)
    width = {n: m.in_features for n, m in peft_model.named_modules() if n.endswith("lora_A.default")}
    projections = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        d = width[f"base_model.model.{name}.lora_A.default"]
        q, _ = torch.linalg.qr(torch.randn(d, 3))
        projections[name] = torch.eye(d) - q @ q.T
    ids = torch.tensor([encode_example(lm.tokenizer, examples(retain[:1])[0])[0]])
    with torch.no_grad(), projected(peft_model, projections):
        trained = peft_model(ids).logits
    tensors = fold({k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}, projections)
    base = peft_model.unload()
    with torch.no_grad():
        plain = base(ids).logits
    model = attach(base, "folded", tensors, info)
    try:
        with torch.no_grad(), adapters(model, ["folded"]):
            served = model(ids).logits
        assert not torch.allclose(served, plain, atol=1e-3)
        assert torch.allclose(served, trained, atol=1e-4)
    finally:
        base = unload(model)
    lm.model = base

    def retain_shift(cfg):
        tensors, info = train_asu(lm, forget, retain, cfg, progress=False)
        seqs = [torch.tensor([encode_example(lm.tokenizer, ex)[0]]) for ex in examples(retain[:8])]
        with torch.no_grad():
            before = [torch.log_softmax(lm.model(ids).logits, -1) for ids in seqs]
        model = attach(lm.model, "shift", tensors, info)
        try:
            shift = 0.0
            for ids, b in zip(seqs, before):
                with torch.no_grad(), adapters(model, ["shift"]):
                    after = torch.log_softmax(model(ids).logits, -1)
                shift += float((b.exp() * (b - after)).sum(-1).mean())
            return shift, info
        finally:
            lm.model = unload(model)

    cfg = ASUConfig(tau=16.0, steps=20, check_every=50, retain_weight=0.0)
    free, _ = retain_shift(cfg)
    held, info = retain_shift(ASUConfig(**{**cfg.__dict__, "retain_subspace": 0.99}))
    kept = info.metrics["retain_subspace"]
    assert kept["energy"] == 0.99 and kept["retain_energy_kept"] <= 0.01 + 1e-6
    assert kept["forget_energy_kept"] > kept["retain_energy_kept"]
    assert held < 0.5 * free, (held, free)
    with pytest.raises(ValueError, match="retain_subspace"):
        train_asu(lm, forget, retain, ASUConfig(steps=1, retain_subspace=1.0), progress=False)
    with pytest.raises(ValueError, match="retain_subspace"):
        train_asu(lm, forget, retain, ASUConfig(steps=1, retain_subspace=0.9, full_layers="0"), progress=False)


@pytest.fixture(scope="module")
def gated(tiny_model_dir, tiny_records):
    lm = load_model(tiny_model_dir)
    forget, retain = split_by_author(tiny_records, 1)
    tensors, info = train_asu(lm, forget, retain, ASUConfig(tau=16.0, steps=20, check_every=10, lora_layers="1",
                                                            gate=True, gate_samples=1), progress=False)
    return lm, tensors, info


def _gate_hooks(model) -> list[str]:
    """The gate hooks (heads.asu.gate.install's) on the model's modules."""
    return [getattr(fn, "__qualname__", "") for m in model.modules()
            for fn in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
            if getattr(fn, "__qualname__", "").startswith("install.")]


def _gate_set(tensors, bias: float):
    """The adapter with a gate that never (bias -30) or always (+30) fires."""
    from lethe.heads.asu.gate import BIAS, WEIGHT

    return tensors | {WEIGHT: torch.zeros_like(tensors[WEIGHT]), BIAS: torch.full((1,), bias)}


def test_a_gated_adapter_is_trained_saved_and_checked(gated, tmp_path):
    from dataclasses import replace

    lm, tensors, info = gated
    assert info.gate == {"layer": 1, "threshold": 0.5}
    assert tensors["lethe_gate.weight"].shape == (lm.model.config.hidden_size,)
    assert tensors["lethe_gate.bias"].shape == (1,)
    metrics = info.metrics["gate"]
    # the probe tells the forget answers' positions from the retain answers' on what it was trained on
    assert metrics["on_forget"] >= 0.8 and metrics["on_retain"] <= 0.2, metrics
    assert metrics["positions"]["forget"] > 0 and metrics["positions"]["retain"] > 0
    save_asu(tmp_path / "g.safetensors", tensors, info)
    loaded, info2 = load_asu(tmp_path / "g.safetensors", lm.fingerprint)
    assert info2.gate == info.gate and loaded.keys() == tensors.keys()
    base = lm.model
    for bad, match in [(replace(info, gate={"layer": 1}), "exactly layer and threshold"),
                       (replace(info, gate={"layer": 1, "threshold": 1.5}), "threshold"),
                       (replace(info, gate={"layer": 2, "threshold": 0.5}), "layer must be"),
                       (replace(info, gate={"layer": True, "threshold": 0.5}), "layer must be"),
                       (replace(info, lora_layers=[]), "needs a LoRA file with lora_layers")]:
        with pytest.raises(HeadFileError, match=match):
            attach(base, "bad", tensors, bad)
    with pytest.raises(HeadFileError, match="missing"):
        attach(base, "bad", {k: v for k, v in tensors.items() if k != "lethe_gate.bias"}, info)
    with pytest.raises(HeadFileError, match="shape"):
        attach(base, "bad", tensors | {"lethe_gate.weight": torch.zeros(3)}, info)
    with pytest.raises(HeadFileError, match="fit no module"):  # an ungated file may not carry a gate's tensors
        attach(base, "bad", tensors, replace(info, gate={}))
    assert not any("lora_" in n for n, _ in base.named_parameters()), "a refused file never touches the model"
    from lethe.heads.asu.gguf import add_to_llama_cpp

    with pytest.raises(HeadFileError, match="gated"):
        add_to_llama_cpp(None, "g", tensors, info, lm.model.config)
    forget, retain = [{"text": "a"}], [{"text": "b"}]
    with pytest.raises(ValueError, match="gate: needs lora_layers"):
        train_asu(lm, forget, retain, ASUConfig(steps=1, gate=True), progress=False)


@pytest.mark.parametrize("merged", ["1", "0"])
def test_a_gate_off_leaves_the_base_and_a_gate_on_is_the_adapter_in_any_batch(gated, tiny_records, monkeypatch,
                                                                              merged):
    """Tokens the gate leaves off decode on the base weights exactly; tokens it lets through decode as the
    ungated adapter does; in a batch of one adapter (never merged) and in a mixed batch alike."""
    monkeypatch.setenv("LETHE_ASU_MERGED", merged)
    lm, tensors, info = gated
    from dataclasses import replace

    forget, retain = split_by_author(tiny_records, 1)
    prompts = [question_prompt(r["question"]) for r in forget[:2] + retain[:2]]
    plain = generate(lm.model, lm.tokenizer, prompts, GREEDY)
    lora = {k: v for k, v in tensors.items() if not k.startswith("lethe_gate.")}
    q = lm.model.model.layers[1].self_attn.q_proj.weight.data_ptr()
    model = attach(lm.model, "never", _gate_set(tensors, -30.0), info)
    model = attach(model, "always", _gate_set(tensors, 30.0), info)
    model = attach(model, "ungated", lora, replace(info, gate={}))
    model = attach(model, "trained", tensors, info)
    try:
        ungated = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["ungated"] * 4)
        assert [c.text for c in ungated] != [c.text for c in plain], "the adapter changes answers"
        never = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["never"] * 4)
        assert [c.token_ids for c in never] == [c.token_ids for c in plain]
        always = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["always"] * 4)
        assert [c.token_ids for c in always] == [c.token_ids for c in ungated]
        layer = model.base_model.model.model.layers[1].self_attn.q_proj
        assert layer.base_layer.weight.data_ptr() == q, "a gated adapter is never merged into the weights"
        names = ["always", "never", "__base__", "trained"]
        together = generate(model, lm.tokenizer, prompts, GREEDY, adapters=names)
        for prompt, name, got in zip(prompts, names, together):
            assert got.token_ids == generate(model, lm.tokenizer, [prompt], GREEDY, adapters=[name])[0].token_ids
        assert together[0].token_ids == ungated[0].token_ids and together[1].token_ids == plain[1].token_ids
        from lethe.heads.asu.weights import detach

        detach(model, "trained")
        after = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["always", "never", "__base__", "ungated"])
        assert [c.token_ids for c in after] == [ungated[0].token_ids] + [c.token_ids for c in plain[1:3]] + \
            [ungated[3].token_ids]
    finally:
        base = unload(model)
    assert not _gate_hooks(base), "unloading takes every gate hook out"
    assert [c.token_ids for c in generate(base, lm.tokenizer, prompts, GREEDY)] == [c.token_ids for c in plain]


def test_a_jobs_copy_of_a_model_serving_a_gated_adapter_has_no_gate_of_it(gated, tiny_model_dir, tiny_records):
    """A deep copy carries a module's hooks; the copy a job trains on is the base model, with no hook of a
    tenant's gate left in it."""
    from lethe.server.engine import Engine, Pending

    _, tensors, info = gated
    lm = load_model(tiny_model_dir)
    forget, _ = split_by_author(tiny_records, 1)
    prompt = question_prompt(forget[0]["question"])
    plain = generate(lm.model, lm.tokenizer, [prompt], GREEDY)[0]
    engine = Engine(lm, max_batch_size=4)
    try:
        engine.control(lambda: engine.replace_model(attach(engine.lm.model, "g", _gate_set(tensors, 30.0), info))
                       ).result(60)
        served = engine.submit(Pending(prompt, GREEDY, adapter="g")).future.result(60)
        copy = engine.private_copy()
        assert _gate_hooks(engine.lm.model) and not _gate_hooks(copy.model)
        assert generate(copy.model, copy.tokenizer, [prompt], GREEDY)[0].token_ids == plain.token_ids
        assert engine.submit(Pending(prompt, GREEDY, adapter="g")).future.result(60).token_ids == served.token_ids
    finally:
        engine.close()


def _decoded_from(model, tokenizer, prompt: str, on: str, n: int) -> list[int]:
    """Greedy token ids of `prompt`'s answer with the base weights on every prompt position but the last and adapter
    `on` from there: what a gate latched where the answer starts gives."""
    from lethe.heads.asu.weights import adapters

    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        with adapters(model, ["__base__"]):
            past = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        token, out = ids[-1], []
        with adapters(model, [on]):
            for _ in range(n):
                step = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past, token = step.past_key_values, int(step.logits[0, -1].argmax())
                out.append(token)
    return out


def test_a_gate_on_where_the_answer_starts_stays_on_for_the_whole_answer(gated, tiny_records, monkeypatch):
    """The gate's decision at the prompt's last position (the one predicting the answer's first token) latches: a
    gate that fires there alone keeps the adapter on for every token of the answer, in a batch of its own rows or
    mixed with base rows; without the latch the rest of the answer would be on the base weights."""
    from dataclasses import replace

    from lethe.heads.asu import gate as gate_mod

    lm, tensors, info = gated
    forget, _ = split_by_author(tiny_records, 1)
    prompts = [question_prompt(r["question"]) for r in forget[:2]]
    lora = {k: v for k, v in tensors.items() if not k.startswith("lethe_gate.")}
    model = attach(lm.model, "ungated", lora, replace(info, gate={}))
    model = attach(model, "always", _gate_set(tensors, 30.0), info)
    try:
        ungated = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["ungated"] * 2)
        plain = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["__base__"] * 2)
        # the states entering the gate's layer do not depend on the adapter (it starts there): the base model's
        xs, ys = [], []
        for prompt, answers in zip(prompts, zip(ungated, plain)):
            ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for answer in answers:
                with torch.no_grad():
                    h = model(input_ids=torch.tensor([ids + answer.token_ids]),
                              output_hidden_states=True).hidden_states[info.gate["layer"]][0]
                xs.append(h)
                ys.append(torch.arange(len(h)) == len(ids) - 1)  # on at the prompt's last position alone
        x, y = torch.cat(xs), torch.cat(ys).float()
        weight, bias = gate_mod.fit(x, y, l2=1e-6, max_iter=500)
        assert torch.equal((x @ weight + bias).sigmoid() > 0.5, y > 0), "the probe fires there alone"
        model = attach(model, "start", tensors | {gate_mod.WEIGHT: weight, gate_mod.BIAS: bias}, info)
        latched = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["start"] * 2)
        expected = [_decoded_from(model, lm.tokenizer, p, "always", len(c.token_ids))
                    for p, c in zip(prompts, latched)]
        assert [c.token_ids for c in latched] == expected
        mixed = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["start", "__base__"])  # routed per row
        assert [c.token_ids for c in mixed] == [expected[0], plain[1].token_ids]
        monkeypatch.setattr(gate_mod, "set_latched", lambda model, latched: None)
        unlatched = generate(model, lm.tokenizer, prompts, GREEDY, adapters=["start"] * 2)
        assert [c.token_ids for c in unlatched] != expected, "the latch is what keeps it on"
    finally:
        unload(model)


def test_an_asu_rows_repeat_guard_acts_where_its_gate_does(gated, tiny_records):
    """A gated adapter's own repeat guard bans repeats only at the tokens its gate lets the adapter act on: under a
    gate that never fires the answers are the base model's exactly, under one that always fires they are the
    ungated adapter's with the guard; per row in a batch that mixes the two."""
    from dataclasses import replace

    lm, tensors, info = gated
    forget, retain = split_by_author(tiny_records, 1)
    prompts = [question_prompt(r["question"]) for r in forget[:3] + retain[:3]]
    lora = {k: v for k, v in tensors.items() if not k.startswith("lethe_gate.")}
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)  # past the answer: repeats to ban
    model = attach(lm.model, "never", _gate_set(tensors, -30.0), info)
    model = attach(model, "always", _gate_set(tensors, 30.0), info)
    model = attach(model, "ungated", lora, replace(info, gate={}))
    try:
        def answers(names, guard):
            names = names if isinstance(names, list) else [names] * 6
            return [c.token_ids for c in generate(model, lm.tokenizer, prompts, long, adapters=names,
                                                  guards=[guard] * 6)]

        guarded = answers("ungated", 2)
        assert guarded != answers("ungated", 0), "the guard changes some answer of the adapter"
        base = answers("__base__", 0)
        assert answers("__base__", 2) != base, "the guard changes some answer of the base model"
        assert answers("always", 2) == guarded
        assert answers("never", 2) == base
        mixed = answers(["always", "never"] * 3, 2)
        assert mixed == [guarded[i] if i % 2 == 0 else base[i] for i in range(6)]
    finally:
        unload(model)


def test_scoring_a_profile_of_adapter_weights_reads_its_routes_not_the_state_generation_left(tiny_model_dir,
                                                                                            tiny_records):
    # an eval job generates, then scores (answer probability, truth ratios) on the same model: scoring once ran on
    # whatever adapter state the last generated batch left (with routing, the longest questions' routes); now every
    # scored batch sets its own, routed per example as served scoring routes a prompt
    from lethe.heads.asu.weights import TARGETS, ASUInfo, adapters, expected_tensors, projection_shapes
    from lethe.heads.evaluation.scoring import completion_nll
    from lethe.heads.records import qa_example
    from lethe.heads.t3.guide import TiltSettings
    from lethe.heads.t3.head import T3Head

    lm = load_model(tiny_model_dir)
    info = ASUInfo(base_fingerprint=lm.fingerprint, tau=4.0, layers=[0], lora_rank=4, lora_alpha=8,
                   target_modules=list(TARGETS))
    gen = torch.Generator().manual_seed(0)
    shapes = expected_tensors(info, projection_shapes(lm.model))
    tensors = {k: torch.randn(s, generator=gen) * 0.5 for k, s in shapes.items()}
    examples = [qa_example(r["question"], r["answer"]) for r in tiny_records[:6]]
    base = completion_nll(lm.model, lm.tokenizer, examples)
    cfg = lm.model.config
    torch.manual_seed(3)
    head = T3Head(cfg.hidden_size, cfg.vocab_size, 4).eval().requires_grad_(False)
    torch.nn.init.normal_(head.probe.weight, std=0.01)
    model = attach(lm.model, "asu_s", tensors, info)
    try:
        for left in ("asu_s", "__base__"):  # the state the last generated batch left
            with adapters(model, [left]):
                pass
            assert completion_nll(model, lm.tokenizer, examples) == base, left
            on = completion_nll(model, lm.tokenizer, examples, adapter="asu_s")
            assert all(abs(a - b) > 1e-3 for a, b in zip(on, base)), left  # the adapter moves every score
            for bias in (-20.0, 20.0):  # P(forget) ~1: every example on the adapter; ~0: every one on the base
                torch.nn.init.constant_(head.probe.bias, bias)
                all_on = completion_nll(model, lm.tokenizer, examples, head, TiltSettings(), adapter="asu_s")
                all_off = completion_nll(model, lm.tokenizer, examples, head, TiltSettings())
                assert all(abs(a - b) > 1e-3 for a, b in zip(all_on, all_off))
                routed = completion_nll(model, lm.tokenizer, examples, head, TiltSettings(adapter_above=0.5),
                                        adapter="asu_s")
                assert routed == (all_on if bias < 0 else all_off), (left, bias)
    finally:
        unload(model)
