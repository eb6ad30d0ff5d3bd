"""python -m dflash.report writes valid PNGs and a report.md for a short demo run."""

import json

from runs import run_colocated, run_disaggregated

from dflash.report import main

PNG = b"\x89PNG\r\n\x1a\n"


def assert_report(run_dir, expected: set[str]) -> None:
    main([str(run_dir)])
    out = run_dir / "report"
    pictures = {p.name for p in out.glob("*.png")}
    assert pictures == expected
    for name in pictures:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name  # a real image, not an empty canvas
    text = (out / "report.md").read_text()
    assert all(f"]({name})" in text for name in pictures)


def test_report_of_a_colocated_run_with_eval(tmp_path):
    run_colocated(tmp_path, ["train.max_steps=6", "eval.enabled=true", "eval.max_prompts=2", "eval.max_new_tokens=24"])
    assert_report(tmp_path, {"loss.png", "acceptance.png", "positions.png", "histogram.png", "throughput.png",
                             "health.png"})
    assert "tau" in (tmp_path / "report" / "report.md").read_text()


def test_report_of_a_disaggregated_run_without_eval(tmp_path):
    run_disaggregated(tmp_path, 2, 1, ["train.max_steps=4"])
    assert json.loads((tmp_path / "ranks.json").read_text())
    assert_report(tmp_path, {"loss.png", "acceptance.png", "positions.png", "throughput.png", "health.png"})
