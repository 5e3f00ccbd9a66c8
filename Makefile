# Two commands on a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv demo test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/python example_project/manage.py demo

test: venv
	bash scripts/test.sh
