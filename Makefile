VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test serve lint clean fuzz soak

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch is pinned explicitly: an open range would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The long runs of the reliability suite (tests/reliability), not part of `make test`:
# schemathesis with 1,000 examples per route and a fresh seed; a 15-minute soak (DURATION=s).
fuzz: $(STAMP)
	RADIXSERVE_FUZZ_EXAMPLES=1000 RADIXSERVE_FUZZ_RANDOM=1 \
		$(PY) -m pytest -q -s -p no:cacheprovider tests/reliability/test_fuzz_openapi.py

soak: $(STAMP)
	$(PY) -m tests.reliability.soak --duration $(or $(DURATION),900)

serve: $(STAMP)
	$(VENV)/bin/radixserve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) build *.egg-info
