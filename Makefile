# Two commands on a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
# `make test`: the package with the dev extra (linters, mypy, pytest, every integration).
STAMP := $(VENV)/.installed
# `make demo`: the package alone (SQLite, no Celery); with REDIS_URL set, plus [redis].
DEMO_EXTRAS := $(if $(REDIS_URL),[redis])
DEMO_STAMP := $(VENV)/.installed-demo$(if $(REDIS_URL),-redis)

.PHONY: venv demo test services

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".$(DEMO_EXTRAS)"
	touch $(DEMO_STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/python example_project/manage.py demo

# The services and the system packages first: [dev]'s mysqlclient builds against MariaDB's
# headers, which scripts/ensure-services.sh installs when they are missing.
services:
	bash scripts/ensure-services.sh

test: services
	$(MAKE) --no-print-directory venv
	bash scripts/test.sh
