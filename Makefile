VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test serve lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch is pinned explicitly: an open range would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

serve: $(STAMP)
	$(VENV)/bin/radixserve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) build *.egg-info
