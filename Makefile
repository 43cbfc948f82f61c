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

.PHONY: bench test microbench state-bench manifests venv tools clean-venv

venv: $(STAMP)
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e . >$(VENV)/install.log 2>&1 \
		|| { cat $(VENV)/install.log; exit 1; }

$(STAMP): $(PINS)
	@echo "building $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q pip==26.3 setuptools==80.9.0
	@$(PY) -m pip install -q -r $(PINS)
	@touch $(STAMP)

tools: $(TOOLS)/.installed

$(TOOLS)/.installed: $(TOOLS_PINS)
	@echo "building $(TOOLS)"
	@$(PYTHON) -m venv $(TOOLS)
	@$(TOOLS)/bin/python -m pip install -q pip==26.3
	@$(TOOLS)/bin/python -m pip install -q -r $(TOOLS_PINS)
	@touch $@

bench: venv
	$(VENV)/bin/cachescout bench $(ARGS)

test: venv tools
	$(VENV)/bin/ruff check -q policy bench connector tests deploy/render.py
	CACHESCOUT_TOOLS=$(TOOLS) $(PY) -m pytest $(ARGS)

manifests: tools
	$(TOOLS)/bin/python deploy/render.py --manifests

microbench: venv
	$(PY) -m cachescout.bench.microbench $(ARGS)

state-bench: venv
	$(PY) -m cachescout.bench.state_bench $(ARGS)

clean-venv:
	rm -rf $(VENV) $(TOOLS)
