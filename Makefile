# Two commands do all the set-up on a fresh machine:
#   make demo   - the whole pipeline, offline, on a built-in corpus with a tiny model
#   make test   - the test suite
# Override the torch build with e.g. `make test TORCH="torch==2.13.0"`.
TORCH ?= torch==2.13.0
PY := .venv/bin/python
PYTEST_ARGS ?=
# Two pytest workers, each test file on one of them (its module fixtures are built once): a 2-process launch
# leaves ~a quarter of 2 cores idle (imports, start-up, teardown), which the other worker's launch fills.
# PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2

.PHONY: env dev-env test demo lint format clean-demo

env:
	@scripts/setup_env.sh "$(TORCH)"

dev-env:
	@scripts/setup_env.sh "$(TORCH)" requirements-dev.txt

test: dev-env
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: env
	$(PY) scripts/demo.py

lint: dev-env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: dev-env
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean-demo:
	rm -rf demo_workspace
