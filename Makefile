PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 torchdata==0.11.0 \
	einops==0.8.2 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0

.PHONY: venv demo test bench fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" -e ".[test]"
	# torchtitan (tests write real torchtitan checkpoints) without its training-only dependencies
	# (datasets, wandb, tensorboard): only what importing its models and CheckpointManager needs
	$(PY) -m pip install -q --no-deps $(TORCHTITAN)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# FUZZ_SECONDS=600 make fuzz: mutate every input format, run inspect + merge, print the outcome table
# (FUZZ_ARGS: more options, e.g. --seed 2032 --work DIR; --replay DIR/bad/NNNNN-CLASS re-runs one case)
fuzz: $(STAMP)
	$(PY) fuzz/harness.py --seconds $${FUZZ_SECONDS:-60} $(FUZZ_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_merge.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
