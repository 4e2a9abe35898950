"""`vase report`: the self-contained HTML page, checked as text and in a real headless Chromium.

Chromium is Debian's `chromium` package; the fixture installs it with apt-get where it is missing
and the machine allows it, and skips with the reason otherwise. Set VASE_REPORT_SCREENSHOT=PATH
to keep the screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers_tiny import tiny_model_and_tokenizer
from tests.test_eval_report import fake_generate
from vase.eval.config import EvalConfig
from vase.eval.html import common_prefix, render_report, write_report
from vase.eval.runner import run_eval


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model, tok = tiny_model_and_tokenizer()
    out = tmp_path_factory.mktemp("html")
    cfg = EvalConfig(task="arith", limit=4, methods=["snapkv"], budgets=[24, 48], window=8, samples=2,
                     max_new_tokens=40, batch_size=8, model="tiny", output_dir=str(out))
    return run_eval(cfg, model, tok, generate_fn=fake_generate, progress=False)


def test_common_prefix() -> None:
    assert common_prefix("abcd", "abxd") == 2 and common_prefix("ab", "abc") == 2 and common_prefix("", "a") == 0


def test_page_is_self_contained(run_dir, tmp_path) -> None:
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count('<table class="summary"') == 1
    # No network at view time: every image is inline, no external script, style or font.
    assert not re.search(r'(?:src|href)="(?!data:|#)', page)
    assert page.count('src="data:image/png;base64,') >= 3
    assert page.count('<details class="problem"') == 4
    assert "Δ pass@1 pts [95% CI]" in page and "full's text beside each method's" in page
    # The fake generator writes the same text for the same (seed, good) outcome: some completions differ
    # from full's and are highlighted from the first differing character.
    assert '<span class="div">' in page
    with pytest.raises(FileNotFoundError):
        render_report(tmp_path)


def test_header_names_the_model_and_its_hash(run_dir, tmp_path) -> None:
    import json

    from vase.models import DEFAULT_MODEL

    meta = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    sha = meta["identity"]["model_sha256"]
    assert f"model tiny (sha256 {sha[:12]})" in render_report(run_dir)
    # The embedded default model has model None in the config: named, never "model None".
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    meta["config"]["model"] = None
    (copy / "config.json").write_text(json.dumps(meta), encoding="utf-8")
    page = render_report(copy)
    assert f"model {DEFAULT_MODEL} (sha256 {sha[:12]})" in page and "model None" not in page


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and apt-get cannot install it here (not root / no apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, capture_output=True, timeout=900,
                       env=env)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"chromium could not be installed with apt-get: {e}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get ran but no chromium binary is on PATH")
    return found


def _headless(chromium: str, page: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-extensions", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=5000", *extra, page.resolve().as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=180)


def _console_errors(stderr: str) -> list[str]:
    """Console messages of level error (Chromium logs them as `...:CONSOLE...` lines)."""
    return [l for l in stderr.splitlines() if "CONSOLE" in l and re.search(r"Uncaught|Error|error", l)]


def test_page_loads_in_headless_chromium(run_dir, tmp_path) -> None:
    chromium = _chromium()
    page = write_report(run_dir, tmp_path / "report.html")
    dom = _headless(chromium, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_errors(dom.stderr) == []
    assert 'data-images-ok="true"' in dom.stdout  # every plot decoded with a non-zero size
    assert 'data-rows="3"' in dom.stdout  # the table rendered: full, snapkv B=24, snapkv B=48

    shot = tmp_path / "report.png"
    res = _headless(chromium, page, f"--screenshot={shot}", "--window-size=1400,1800", "--hide-scrollbars")
    assert res.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    keep = os.environ.get("VASE_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)

    # The console check can fail: a page with a script error is caught by the same check.
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    assert _console_errors(_headless(chromium, bad, "--dump-dom").stderr) != []
