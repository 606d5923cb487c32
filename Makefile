# Two entry points: `make run` serves on 127.0.0.1:50051, `make test` runs the suite.
# Both create .venv and install into it on first use: the SDK and the server (two
# distributions: this directory and ./server) for `run`, with the test tools (and a CPU torch
# with transformers, for the presets' conformance tests) for `test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVER_STAMP := $(VENV)/.installed-server
STAMP := $(VENV)/.installed

.PHONY: run test test-fast test-newest soak lint typecheck stubs clean plots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(SERVER_STAMP): pyproject.toml server/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e . -e ./server
	touch $@

$(STAMP): pyproject.toml server/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,conformance]' -e ./server
	touch $@

run: $(SERVER_STAMP)
	$(BIN)/posenc-server

# Two pytest workers, each module's tests in one of them (see tests/conftest.py).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2

# The integration suites against the newest transformers, diffusers, vLLM and SGLang, resolved
# now into an environment of their own (.venv-newest, made anew each run): what a user who
# installs the latest releases today gets. The tests download the newest vLLM and SGLang
# wheels themselves; torch stays the CPU build the tests pin.
NEWEST := .venv-newest
NEWEST_TESTS := $(filter-out tests/test_integrations_transformers_oldest.py,$(wildcard tests/test_integrations_*.py)) tests/test_conformance.py tests/test_multiaxis_conformance.py

test-newest: $(STAMP)
	rm -rf $(NEWEST)
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet -e '.[dev]' -e ./server 'torch==2.13.0'
	$(NEWEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy only-if-needed transformers diffusers 'torch==2.13.0'
	$(NEWEST)/bin/python -c 'import importlib.metadata as m; print("newest:", ", ".join(f"{n} {m.version(n)}" for n in ("transformers", "diffusers", "torch")))'
	POSENC_NEWEST=1 $(NEWEST)/bin/python -m pytest -n 2 $(NEWEST_TESTS)

# The fast set, for the edit-test loop: under a minute, no slow or soak tests, no linters.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not soak" -q

# The proof under pressure in full: 120 s of load and 5,000 cache keys (tests/test_soak.py),
# every attack at once for 10 minutes beside real clients (tests/test_attacks.py): ~25 min.
soak: $(STAMP)
	POSENC_SOAK=1 $(BIN)/python -m pytest tests/test_soak.py tests/test_bad_input.py tests/test_table_ranges.py tests/test_spec_memory.py tests/test_attacks.py -s

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

stubs: $(STAMP)
	$(BIN)/python scripts/generate_stubs.py

# The README's pictures (pictures/*.png), drawn from a server started for the purpose.
plots: $(STAMP)
	$(BIN)/python scripts/make_plots.py pictures

clean:
	rm -rf $(VENV) $(NEWEST) .pytest_cache .mypy_cache .ruff_cache

# Benchmarks against the physical floors (bench/README.md): results in bench/results/.
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: bench bench-quick

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m bench

bench-quick: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python -m bench --quick

# The documentation site (mkdocs.yml) into build/site, strict: a broken link, anchor or API
# reference fails it. `make test` runs the same build (tests/test_docs.py). It installs the
# docs tools alone (the docs extra): not the test tools' torch and transformers.
.PHONY: docs
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict
