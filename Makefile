# Two commands do all the set-up on a fresh machine:
#   make demo   - the whole pipeline, offline, on a built-in corpus with a tiny model
#   make test   - the test suite
# Override the torch build with e.g. `make test TORCH="torch==2.13.0"`.
TORCH ?= torch==2.13.0
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: env dev-env test demo lint format clean-demo

env:
	@scripts/setup_env.sh "$(TORCH)"

dev-env:
	@scripts/setup_env.sh "$(TORCH)" requirements-dev.txt

test: dev-env
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

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
