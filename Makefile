PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-gpu bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch first, so the range in pyproject.toml installs nothing larger
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.11,<2.14"

install: $(PY)
	$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m dflash.train
	$(PY) -m dflash.eval --drafter outputs/demo/export

test: install
	$(PY) -m pytest -q -m "not gpu"

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) outputs
