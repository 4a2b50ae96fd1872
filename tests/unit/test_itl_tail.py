"""``python -m bench.itl_tail`` on a run whose streams all stall while one long prompt prefills."""

from __future__ import annotations

import json

import pytest

from bench.itl_tail import find_stalls, main, per_prompt_token_ms


def stream(index: int, times: list[float]) -> dict:
    return {"index": index, "status": 200, "sent_at": 0.0, "ttft": times[0], "prompt_tokens": 32, "chunk_times": times}


def run_records() -> list[dict]:
    steady = [0.1 * i for i in range(1, 16)]  # a token every 100 ms up to 1.5 s
    stalled = steady + [1.8, 1.9]  # the step from 1.5 to 1.8 s prefilled the long prompt
    records = [stream(0, stalled), stream(1, [t + 0.001 for t in stalled])]
    # The long prompt: sent at 1.45 s, its first token at the stall's end.
    records.append(
        {"index": 2, "status": 200, "sent_at": 1.45, "ttft": 0.351, "prompt_tokens": 1000, "chunk_times": [1.801]}
    )
    # A refused request has no first token and ends no stall.
    records.append({"index": 3, "status": 429, "sent_at": 1.0, "ttft": None, "prompt_tokens": 500, "chunk_times": []})
    return records


def test_the_stall_is_found_once_with_the_prompt_that_ended_it():
    stalls = find_stalls(run_records(), min_gap_s=0.12)
    assert len(stalls) == 1
    (stall,) = stalls
    assert stall.streams == 2 and stall.prefilled == (1000,)
    assert stall.longest_gap_s == pytest.approx(0.3, abs=0.002)
    assert per_prompt_token_ms(stalls) == [pytest.approx(0.3, abs=0.002)]
    assert find_stalls(run_records(), min_gap_s=0.4) == []


def test_cli_prints_the_stall_and_the_per_token_cost(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"all": {}, "records": run_records()}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 stalls over 120 ms" in out
    assert "2 streams  first tokens of prompts: 1000" in out
    assert "0.300 / 0.300 / 0.300 ms" in out


def test_a_file_that_is_no_bench_report_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"something": 1}))
    with pytest.raises(SystemExit, match="not a shapeserve bench --output-json file"):
        main([str(path)])
