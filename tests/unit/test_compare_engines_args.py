"""``python -m bench.compare_engines`` refuses what neither engine could run before it starts either of them (the
vLLM engine used to fail on a 2048-token prompt minutes into the run)."""

from __future__ import annotations

import pytest

from bench.compare_engines import MAX_MODEL_LEN, main


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--prefill-parts", f"256,{MAX_MODEL_LEN}"], "leave no room for an output"),
        (["--mixed", f"16x{MAX_MODEL_LEN}"], "leave no room for an output"),
        (["--context", str(MAX_MODEL_LEN - 10)], "leaves no room for the 26 tokens each running decode generates"),
    ],
)
def test_prompts_without_room_for_an_output_are_refused_up_front(argv, why):
    with pytest.raises(SystemExit, match=why):
        main(argv)


def test_lengths_that_fit_pass_the_check(tmp_path, monkeypatch):
    # Past the check, the next thing it looks for is the bench model: its absence is the refusal that follows.
    monkeypatch.setattr("bench.compare_engines.MODEL_DIR", tmp_path / "no-model")
    with pytest.raises(SystemExit, match="no model at"):
        main(["--prefill-parts", "1536", "--context", "1024"])
