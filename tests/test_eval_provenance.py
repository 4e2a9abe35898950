"""An eval run records its own provenance (commit, dirty flag, machine, load at start and end) and
scripts/eval_results.py carries it into the results file, not the commit and load of whoever ran the script.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers_tiny import tiny_model_and_tokenizer
from tests.test_eval_runner import fake_generate
from vase.eval.config import EvalConfig
from vase.eval.run_provenance import FILE, read_events, run_provenance
from vase.eval.runner import run_eval

REPO = Path(__file__).resolve().parents[1]


def _eval_results():
    spec = importlib.util.spec_from_file_location("eval_results", REPO / "scripts" / "eval_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model, tok = tiny_model_and_tokenizer(dtype=torch.float64)
    cfg = EvalConfig(task="arith", limit=2, methods=["snapkv"], budgets=[24], window=8, name="prov",
                     model="tiny", output_dir=str(tmp_path_factory.mktemp("runs")))
    return run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)


def test_the_run_records_its_commit_machine_and_load_at_start_and_end(run_dir):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    events = read_events(run_dir)
    assert [e["event"] for e in events] == ["start", "end"]
    start, end = events
    assert start["commit"] == head and isinstance(start["dirty"], bool)
    assert start["machine"]["cpu"] and isinstance(start["machine"]["loadavg_1m"], float)
    assert start["versions"]["torch"] == torch.__version__
    assert isinstance(end["loadavg_1m"], float) and end["date"] >= start["date"]
    rec = run_provenance(run_dir)
    assert rec["commit"] == head and rec["machine"]["loadavg_1m_after"] == end["loadavg_1m"]
    assert rec["finished"] == end["date"] and rec["processes"] == 1


def test_eval_results_carries_the_runs_provenance_not_its_own(run_dir, tmp_path):
    # Pretend the run was made at another commit, dirty, at another load: the results file must say so.
    events = read_events(run_dir)
    events[0].update(commit="f" * 40, dirty=True, date="2026-01-02T03:04:05+00:00")
    events[0]["machine"]["loadavg_1m"] = 9.25
    events[1].update(loadavg_1m=7.5, date="2026-01-02T03:09:00+00:00")
    copy = tmp_path / "run"
    copy.mkdir()
    for p in run_dir.iterdir():
        if p.is_file() and p.name != FILE:
            (copy / p.name).write_bytes(p.read_bytes())
    (copy / FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    out = tmp_path / "r.json"
    assert _eval_results().main([str(copy), str(out)]) == 0
    prov = json.loads(out.read_text())["provenance"]
    assert prov["commit"] == "f" * 40 and prov["dirty"] is True
    assert prov["date"] == prov["run_started"] == "2026-01-02T03:04:05+00:00"
    assert prov["run_finished"] == "2026-01-02T03:09:00+00:00"
    assert prov["machine"]["loadavg_1m"] == 9.25 and prov["machine"]["loadavg_1m_after"] == 7.5
    assert prov["rendered"] > prov["run_finished"]  # the script's own time, kept apart


def test_a_resume_at_another_commit_is_recorded_and_dirty_anywhere_is_dirty(run_dir, tmp_path):
    events = read_events(run_dir)
    second = {**events[0], "commit": "a" * 40, "dirty": True}
    (tmp_path / FILE).write_text("".join(json.dumps(e) + "\n" for e in [*events, second]))
    rec = run_provenance(tmp_path)
    assert rec["commits"] == [events[0]["commit"], "a" * 40] and rec["dirty"] is True and rec["processes"] == 2
    assert "finished" in rec


def test_eval_results_refuses_a_run_without_provenance_or_unfinished(run_dir, tmp_path):
    copy = tmp_path / "old"
    copy.mkdir()
    for p in run_dir.iterdir():
        if p.is_file() and p.name != FILE:
            (copy / p.name).write_bytes(p.read_bytes())
    er = _eval_results()
    with pytest.raises(SystemExit, match="commit it ran at is unknown"):
        er.main([str(copy), str(tmp_path / "r.json")])
    (copy / FILE).write_text(json.dumps(read_events(run_dir)[0]) + "\n")  # started, never ended
    with pytest.raises(SystemExit, match="has not finished"):
        er.main([str(copy), str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
