# Two entry points: `make demo` and `make test`. Each creates .venv when missing and installs what it needs.
# torch is installed on its own first, pinned, so pip never resolves `torch>=2.4` to a multi-GB CUDA build;
# on these machines torch==2.13.0 is a local CPU wheel.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.tbo-installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,plot,hf]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/executor_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
