PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# FUZZ_SECONDS=600 make fuzz: mutate every input format, run inspect + merge, print the outcome table
fuzz: $(STAMP)
	$(PY) fuzz/harness.py --seconds $${FUZZ_SECONDS:-60}

bench: $(STAMP)
	$(PY) benchmarks/bench_merge.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
