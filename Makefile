# make test   - create .venv if missing, install the project with its test extras, run the CPU test suite
# make run    - the demo
# make bench  - benchmarks (JSON lines)
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: install test run bench clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# the CPU wheel of torch lies on disk; install it before the project so nothing pulls a CUDA build
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,gpu,ray,wandb,nixl,server,demo]'
	# verl for its plugin's tests, without its training stack (whose pins would move transformers): the modules the
	# plugin's imports need (docs/INTEGRATIONS.md)
	$(VPY) -m pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 omegaconf hydra-core antlr4-python3-runtime==4.9.3 \
		codetiming pyvers cloudpickle orjson cachetools
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -x --durations=15 tests

run: $(STAMP)
	$(VPY) -m rollout demo

bench: $(STAMP)
	$(VPY) bench/generate.py

clean:
	rm -rf $(VENV) .pytest_cache
