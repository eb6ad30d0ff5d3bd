PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-gpu mutate reproduce clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch first, so the range in pyproject.toml installs nothing larger
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.11,<2.14"

install: $(PY)
	$(PY) -m pip install -q -e ".[test]"

# one target process and one drafter process; speculative decoding on held-out prompts every 100
# steps and at the end, then the pictures of the run in outputs/demo/report/; ARGS adds overrides
# (make demo ARGS="drafter.variant=dflash2 drafter.block_size=8")
demo: install
	rm -rf outputs/demo
	PYTHON=$(PY) NPROC=2 ./launch.sh topology.target_ranks=1 eval.every=100 $(ARGS)
	$(PY) -m dflash.report outputs/demo

# two workers: half the tests start processes that wait on each other, and 2 cores run it in
# 13 minutes instead of 15; TEST_WORKERS=0 runs them in this process, one after another
TEST_WORKERS ?= 2

# the fp8 extra too: torchao's float8 training runs on the CPU, so the FP8 tests run here as well
test: install
	$(PY) -m pip install -q -e ".[test,fp8]"
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu"

test-gpu: install
	$(PY) -m pytest -q -m gpu

# mutation testing of one module against the tests that cover it (docs/testing.md): minutes a module on 2 cores, so
# not part of `test`. TESTS: pytest arguments choosing the tests (default: the test files that import MODULE);
# ONLY: globs of mutant names, to test some functions' mutants only (ONLY="dflash.prompts.x_held_out*")
# make mutate MODULE=dflash/run/warmup.py [TESTS="tests/run/test_warmup.py tests/run/test_warmup_pins.py"]
mutate: install
	$(PY) -m pip install -q -e ".[test,mutate]"
	$(PY) tools/mutate.py $(MODULE) $(if $(TESTS),--tests "$(TESTS)") $(foreach g,$(ONLY),--only "$(g)")

# recipes/qwen3_8b.sh: MODEL=/models/Qwen3-8B PROMPTS=prompts.jsonl RELEASED=/models/Qwen3-8B-DFlash-b16
# [WORK=runs/qwen3_8b] [DRY_RUN=1] [SERVER=http://host:8000]; the table lands in $(WORK)/acceptance.md
WORK ?= runs/qwen3_8b
reproduce: install
	PYTHON=$(PY) recipes/qwen3_8b.sh "$(MODEL)" "$(PROMPTS)" "$(RELEASED)" "$(WORK)"

clean:
	rm -rf $(VENV) outputs mutants
