# Two commands on a fresh clone (README, first section):
#   make demo   creates .venv if missing, installs kconvert with its test tools, converts the
#               bundled tiny Kimi-K2-Thinking INT4 checkpoint to NVFP4 and audits it
#   make test   the same venv; the versions it runs with, ruff, then the test suite in two
#               processes, each module's tests in one (what CI runs: .ci/run)
#   make lock   refreshes constraints.txt with the newest versions the ranges in pyproject.toml
#               admit (then run `make test` and commit both if it passes)

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# The exact versions the suite last passed with; pyproject.toml keeps ranges for users.
LOCK := constraints.txt
DEMO_SRC := tests/fixtures/tiny-k2-thinking-int4
DEMO_DST ?= /tmp/tiny-nvfp4
BIN := $(VENV)/bin

.PHONY: demo test install lock

demo: install
	$(BIN)/kconvert int4-to-nvfp4 $(DEMO_SRC) $(DEMO_DST) --overwrite
	$(BIN)/kconvert audit $(DEMO_DST) --source $(DEMO_SRC)

test: install
	$(BIN)/python scripts/print_versions.py
	$(BIN)/ruff check kconvert scripts tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadscope

install: $(VENV)/.installed

# Reinstalled when pyproject.toml or the lock changes (the dependencies may have).
$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) "$(TORCH)" -e ".[test]"
	touch $@

# A throw-away venv resolved without the lock: its versions become the new lock. torch stays
# out of the lock (TORCH above pins it, and a GPU user's CUDA build must not be replaced).
lock:
	rm -rf $(VENV)-lock
	$(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/python -m pip install -q --upgrade pip
	$(VENV)-lock/bin/python -m pip install -q "$(TORCH)" -e ".[test]"
	{ echo "# The exact versions the test suite last passed with (make install uses them)."; \
	  echo "# Refresh: make lock, then make test; commit both if it passes."; \
	  $(VENV)-lock/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|pip)=='; \
	} > $(LOCK)
	rm -rf $(VENV)-lock
