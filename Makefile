PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 torchdata==0.11.0 \
	einops==0.8.2 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0

# The compatibility pass (docs/compatibility.md): two transformers 4.x stacks, each on the same CPU
# torch in a venv of its own, run the tests marked `compat`: 4.57 (verl 0.7 with sglang 0.5.6 pins
# 4.57.1) and the declared floor 4.51.1 (verl 0.5 with sglang 0.4.6.post5 pins it; vllm 0.8.5 asks >= it).
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
COMPAT_OLDEST_VENV ?= .venv-compat-4.51
COMPAT_OLDEST_PY := $(COMPAT_OLDEST_VENV)/bin/python
COMPAT_OLDEST_STAMP := $(COMPAT_OLDEST_VENV)/.installed
STACK_4X_REST := peft==0.17.1 accelerate==1.10.1 "huggingface_hub>=0.34,<0.35" safetensors==0.4.3
STACK_4X := transformers==4.57.6 $(STACK_4X_REST)
STACK_451 := transformers==4.51.1 $(STACK_4X_REST)
COMPAT_TEST := pytest pytest-timeout megatron-core==0.16.1 gguf==0.19.0 sentencepiece==0.2.3 protobuf==7.36.2
# $(call compat_venv,VENV,STACK,TRANSFORMERS): a venv of torch 2.13.0 and STACK with hf-merge installed
# into it, checked to keep that torch and transformers (installing hf-merge must not change them)
compat_venv = $(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install -q --upgrade pip && \
	$(1)/bin/python -m pip install -q torch==2.13.0 $(2) $(COMPAT_TEST) && $(1)/bin/python -m pip install -q -e . && \
	$(1)/bin/python -c "from importlib.metadata import version as v; \
		assert (v('torch'), v('transformers')) == ('2.13.0+cpu', '$(3)'), (v('torch'), v('transformers'))" && \
	touch $(1)/.installed

# The torch-runtime pass (docs/compatibility.md), not in CI (several GB of CUDA wheels, run on CPU):
# the oldest declared torch with the oldest transformers stack (torch 2.6.0 + transformers 4.51.1: verl 0.5
# with sglang 0.4.6.post5), the newest torch with the `test` extra.
# torch is installed first and pinned again beside the stack, and checked after: pip may not change it.
TORCH_OLDEST := 2.6.0
TORCH_NEWEST := 2.15.0
OLDEST_VENV ?= .venv-torch-oldest
NEWEST_VENV ?= .venv-torch-newest
# this machine's pip config caps torch at 2.14.1 (/etc/xdg/pip); the newest venv installs without it
NEWEST_PIP := PIP_CONFIG_FILE=/dev/null $(NEWEST_VENV)/bin/python -m pip
# $(call torch_is,PYTHON,VERSION): fail unless PYTHON imports torch VERSION (a local +cu124 part aside)
torch_is = $(1) -c "import sys, torch; print('torch', torch.__version__); \
	sys.exit(torch.__version__.split('+')[0] != '$(2)' and 'torch is not $(2) any more')"
# $(call torch_tests,PYTHON): the compat subset, then the checkpoints written by each torch release
# (both run; either failing fails the target)
torch_tests = $(1) -m pytest -q -m compat tests; a=$$?; $(1) -m pytest -q tests/test_torch_versions.py && exit $$a

.PHONY: venv demo test test-slow test-all test-compat compat compat-oldest compat-newest bench fuzz clean

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

# `make test`: everything but the tests marked `slow` (end-to-end runs of many processes);
# `make test-slow`: those alone; CI (.ci/run) runs both, then the compatibility pass
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

test-all: test test-slow

$(COMPAT_STAMP): pyproject.toml Makefile
	$(call compat_venv,$(COMPAT_VENV),$(STACK_4X),4.57.6)

$(COMPAT_OLDEST_STAMP): pyproject.toml Makefile
	$(call compat_venv,$(COMPAT_OLDEST_VENV),$(STACK_451),4.51.1)

# both stacks run; either failing fails the target
test-compat: $(COMPAT_STAMP) $(COMPAT_OLDEST_STAMP)
	$(COMPAT_PY) -m pytest -q -m compat tests; a=$$?; $(COMPAT_OLDEST_PY) -m pytest -q -m compat tests && exit $$a

$(OLDEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q torch==$(TORCH_OLDEST)
	$(OLDEST_VENV)/bin/python -m pip install -q torch==$(TORCH_OLDEST) $(STACK_451) $(COMPAT_TEST) -e .
	$(call torch_is,$(OLDEST_VENV)/bin/python,$(TORCH_OLDEST))
	touch $@

$(NEWEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PIP) install -q --upgrade pip
	$(NEWEST_PIP) install -q torch==$(TORCH_NEWEST)
	$(NEWEST_PIP) install -q torch==$(TORCH_NEWEST) -e ".[test]"
	$(call torch_is,$(NEWEST_VENV)/bin/python,$(TORCH_NEWEST))
	touch $@

compat-oldest: $(OLDEST_VENV)/.installed
	$(call torch_tests,$(OLDEST_VENV)/bin/python)

compat-newest: $(NEWEST_VENV)/.installed
	$(call torch_tests,$(NEWEST_VENV)/bin/python)

compat: compat-oldest compat-newest

# FUZZ_SECONDS=600 make fuzz: mutate every input format, run inspect + merge, print the outcome table
# (FUZZ_ARGS: more options, e.g. --seed 2032 --work DIR; --replay DIR/bad/NNNNN-CLASS re-runs one case)
fuzz: $(STAMP)
	$(PY) fuzz/harness.py --seconds $${FUZZ_SECONDS:-60} $(FUZZ_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_merge.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(COMPAT_OLDEST_VENV) $(OLDEST_VENV) $(NEWEST_VENV) build *.egg-info .pytest_cache
