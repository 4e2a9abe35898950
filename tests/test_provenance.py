"""vase.files.provenance: the record every results file carries, and the file round trip."""

import json
import subprocess
from pathlib import Path

import pytest

from vase.files import provenance as prov


def test_record_names_commit_machine_versions_and_command():
    record = prov.finish(prov.provenance(["vase", "bench", "--repeats", "5"], settings={"B": 512}))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert record["commit"] == head.stdout.strip()
    assert record["command"] == "vase bench --repeats 5"
    assert record["settings"] == {"B": 512}
    assert record["machine"]["cores"] >= 1 and isinstance(record["machine"]["simd"], list)
    assert "loadavg_1m" in record["machine"] and "loadavg_1m_after" in record["machine"]
    assert record["versions"]["torch"] and record["versions"]["transformers"]
    assert record["date"][:4].isdigit() and record["date"].endswith("+00:00")


def test_write_then_read_round_trip_and_refuses_other_json(tmp_path):
    rows = [{"method": "snapkv", "ratio": 1.07}, {"method": "full", "ratio": 1.0}]
    record = prov.provenance("cmd")
    path = prov.write_results(tmp_path / "sub" / "r.json", rows, record)
    got_record, got_rows = prov.read_results(path)
    assert got_rows == rows and got_record == record
    assert not list(path.parent.glob("*.tmp"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a results file"):
        prov.read_results(bad)
