# Two commands on a fresh machine: `make test` and `make demo`. Both create .venv when absent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: test test-fast demo lint bench docs install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,torch,transformers,plot,docs]"
	$(BIN)/python -m coordinator.pipeline.planner.warm
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The pure tiers alone (cores and the wire contract: no server, no process), in under a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m core

lint: $(STAMP)
	$(BIN)/ruff check zeus_agent coordinator zeus_demo tests bench tools
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/zeus-demo

# The documentation site into site/: reference pages regenerated from the code, then a strict build.
docs: $(STAMP)
	$(BIN)/python tools/gen_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	for b in bench/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
