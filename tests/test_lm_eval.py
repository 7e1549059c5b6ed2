"""lm-evaluation-harness itself against a live server (issue 25): `lm_eval --model local-completions` with no key,
as its users run it on a local server, on two small local tasks: multiple choice by log-likelihood (prompts sent as
token ids, echo, logprobs, max_tokens 0) and greedy generation (generate_until), the tokenizer read from the server
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize).

lm-evaluation-harness is not one of Lethe's dependencies: `make lm-eval` installs it from requirements-lmeval.lock
and CI does (`.ci/run`); a developer without it skips this test, CI fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec

import pytest

from lethe.heads.modelio import load_model
from live_server import running_server

LIMIT = 6


@pytest.fixture(scope="module")
def lm_eval_installed():
    if find_spec("lm_eval") is None:
        if os.environ.get("CI"):
            pytest.fail("lm-evaluation-harness is missing: `make lm-eval` installs it (CI runs it)")
        pytest.skip("lm-evaluation-harness is not installed: run `make lm-eval`")


def _tasks(folder, records) -> None:
    """Two tasks on the tiny model's own records: pick the answer among the record's perturbed ones (acc), and say
    the answer (exact_match, the generation's leading space removed)."""
    docs = [{"question": r["question"], "answer": r["answer"], "choices": [r["answer"], *r["perturbed_answer"][:3]]}
            for r in records if len(r.get("perturbed_answer", [])) >= 3][:LIMIT]
    assert len(docs) == LIMIT
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n")
    (folder / "lethe_mc.yaml").write_text(
        "task: lethe_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: 0\nmetric_list:\n  - metric: acc\n")
    (folder / "lethe_gen.yaml").write_text(
        "task: lethe_gen\n" + common + "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n  do_sample: false\n  temperature: 0\n"
        "filter_list:\n  - name: strip\n    filter:\n      - function: remove_whitespace\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n")


def test_lm_eval_local_completions_scores_loglikelihood_and_generation_on_a_live_server_without_a_key(
        lm_eval_installed, tiny_model_dir, tiny_records, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _tasks(tasks, tiny_records)
    lm = load_model(tiny_model_dir)
    context = lm.model.config.max_position_embeddings
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "LETHE_KEY")}  # no key: anonymous
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}
    with running_server(lm, tmp_path / "data") as url:
        model_args = (f"model=base,base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                      f"max_retries=1,max_length={context},timeout=60")
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                              "--model_args", model_args, "--tasks", "lethe_mc,lethe_gen",
                              "--include_path", str(tasks), "--limit", str(LIMIT),
                              "--output_path", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        took = time.monotonic() - started
    assert run.returncode == 0, (took, run.stdout[-3000:] + run.stderr[-5000:])
    (results,) = list((tmp_path / "out").rglob("results_*.json"))
    scores = json.loads(results.read_text())["results"]
    mc, gen = scores["lethe_mc"], scores["lethe_gen"]
    # the tiny model memorised these records: it ranks the true answer first and says it, mostly
    assert 0.5 <= mc["acc,none"] <= 1, (mc, took)
    assert 0.5 <= gen["exact_match,strip"] <= 1, (gen, took)
    assert "Traceback" not in run.stderr and "ERROR" not in run.stderr, run.stderr[-5000:]
