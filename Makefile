# Two commands from a fresh clone: `make run` and `make test`. Each bootstraps .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test run bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --timeout=600 $(PYTEST_ARGS)

run: $(STAMP)
	$(VENV)/bin/kvstore serve

bench: $(STAMP)
	$(VENV)/bin/kvstore bench --out bench-results

lint: $(STAMP)
	$(VENV)/bin/ruff check kvstore engine kernels api tools tests
	$(PYTHON) ../shared/checks/layering.py . || $(PY) -c "print('layering check not available')"

clean:
	rm -rf $(VENV) .pytest_cache bench-results
