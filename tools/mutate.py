"""Mutation testing of one module with the tests that cover it (mutmut 3), for the modules a
change touches: which one- or two-line bugs would the suite let through?

    make mutate MODULE=dflash/run/warmup.py                              # its tests found by import
    make mutate MODULE=recipes/table.py TESTS="tests/commands/test_table_pins.py"
    make mutate MODULE=dflash/run/warmup.py TESTS="tests/run/test_warmup.py -k 'not buckets_its'"
    make mutate MODULE=dflash/prompts.py ONLY="dflash.prompts.x_held_out*"   # some functions' mutants only

mutmut copies ``source_paths`` (``[tool.mutmut]`` in pyproject.toml: the packages, and conf/
beside them) into ``mutants/``, rewrites every function of the module into its mutants, runs
the selected tests once to learn which test reaches which function, then each mutant against
the tests that reach it, two at a time by default. mutmut reads its settings from a file only;
this script takes the shared ones from pyproject.toml and sets the two that change per module
(``only_mutate``, ``pytest_add_cli_args_test_selection``) on the config mutmut loaded, before
its command runs. Each run starts from an empty ``mutants/`` so that the counts are this
module's against these tests (mutmut would otherwise keep the verdicts it has, also those of
a survivor that a new test now kills).

The counts and the survivors' names are printed at the end; from the repository root,
``.venv/bin/mutmut show NAME`` prints a survivor's diff and ``.venv/bin/mutmut browse`` lists
them. Not part of ``make test`` or CI: minutes per module on 2 cores. Where a
test runs a whole training run, exclude it with ``-k`` (each surviving mutant runs every test
that reaches it).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dotted(module: str) -> str:
    """``dflash/run/warmup.py`` as ``dflash.run.warmup``."""
    return Path(module).with_suffix("").as_posix().replace("/", ".")


def covering_tests(module: str) -> list[str]:
    """The test files that import ``module`` by its dotted name."""
    name = re.escape(dotted(module))
    parent, _, leaf = dotted(module).rpartition(".")
    pattern = re.compile(rf"\b{name}\b|from {re.escape(parent)} import [^\n]*\b{re.escape(leaf)}\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if pattern.search(p.read_text(encoding="utf-8")))


def counts(module: str, only: list[str]) -> tuple[Counter, list[str]]:
    """How many of the module's mutants (those ``only`` matches, where given) ended each way,
    and the names of the survivors."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((ROOT / "mutants" / f"{module}.meta").read_text())
    statuses = {name: status_by_exit_code[code] for name, code in meta["exit_code_by_key"].items()
                if not only or any(fnmatch.fnmatch(name, glob) for glob in only)}
    return Counter(statuses.values()), sorted(n for n, s in statuses.items() if s in ("survived", "no tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", help="a source file, e.g. dflash/run/warmup.py")
    ap.add_argument("--tests", default=None,
                    help="pytest arguments selecting the tests (one string, shell-quoted); "
                         "default: the test files that import the module")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    ap.add_argument("--only", action="append", default=[], metavar="GLOB",
                    help="test only the mutants whose names match, e.g. 'dflash.prompts.x_held_out*' (repeatable)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # mutmut reads pyproject.toml and writes mutants/ in the working directory
    if not Path(args.module).is_file():
        ap.error(f"{args.module}: no such file")
    tests = shlex.split(args.tests) if args.tests else covering_tests(args.module)
    if not tests:
        ap.error(f"no test file imports {dotted(args.module)}: name them with --tests")
    print(f"mutating {args.module} against: {' '.join(tests)}", flush=True)

    from mutmut.configuration import config

    cfg = config()  # loaded once from pyproject.toml and kept: what the command below reads
    cfg.only_mutate = [args.module]
    cfg.pytest_add_cli_args_test_selection = tests
    shutil.rmtree(ROOT / "mutants", ignore_errors=True)

    from mutmut.__main__ import cli

    code = 0
    try:
        cli(["run", "--max-children", str(args.max_children), *args.only], standalone_mode=False)
    except SystemExit as e:  # mutmut exits 1 where no selected test reaches the module, its mutants untested
        code = e.code if isinstance(e.code, int) else 1
    if not (ROOT / "mutants" / f"{args.module}.meta").is_file():
        return code or 1
    found, survivors = counts(args.module, args.only)
    made = sum(found.values())
    print(f"\n{args.module}: {made} mutants, {found['killed']} killed, {found['survived']} survived"
          + "".join(f", {n} {status}" for status, n in sorted(found.items()) if status not in ("killed", "survived")))
    for name in survivors:
        print(f"  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
