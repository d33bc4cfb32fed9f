"""Open a finished search in the MLflow UI as a new user would, in a real browser.

    python -m bench.ui_check --experiment-dir ray_results/smart-small-... [--out ui_check]

Starts ``mlflow ui`` on the search's store (127.0.0.1, a free port), opens the two links
the driver prints ("runs, best first" and "this search") in headless Chromium with a fresh
profile each, saves a screenshot of each and checks the rendered page: the runs table in
the "Model training" view (not MLflow 3's GenAI overview), the shared view sorted by
``best/val/overall``, the search's parent run and every trial run listed.  Prints one line
per check and exits 1 if one fails.  Needs Chromium (Debian: ``apt-get install chromium``);
on demand, not in the test suite (a browser is not part of the install).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mtbert.tune.results.mlflow_results import LOCAL_UI, ui_links


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browse(url: str, screenshot: Path) -> str:
    """The page's DOM once rendered, and a screenshot of it; each in a fresh profile."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("error: Chromium not found (Debian: apt-get install chromium)")
    outputs = []
    for action in (f"--screenshot={screenshot}", "--dump-dom"):
        with tempfile.TemporaryDirectory(prefix="mtbert-ui-") as profile:
            outputs.append(subprocess.run(
                [chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                 f"--user-data-dir={profile}", "--window-size=1700,1000",
                 "--virtual-time-budget=20000", action, url],
                capture_output=True, text=True, timeout=180, check=True).stdout)
    return outputs[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment-dir", required=True, help="a finished search's folder")
    p.add_argument("--out", default="ui_check", help="screenshots go here")
    args = p.parse_args(argv)
    summary = json.loads((Path(args.experiment_dir) / "summary.json").read_text())
    refs = summary["mlflow"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                               refs["tracking_uri"], "--host", "127.0.0.1", "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failures = 0
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        links = ui_links(refs["tracking_uri"], refs["experiment_id"], refs["parent_run_id"],
                         refs.get("runs_view"))
        urls = {line.split(": ", 1)[0]: line.split(": ", 1)[1].replace(
            LOCAL_UI, f"http://127.0.0.1:{port}") for line in links if ": http" in line}
        trials = [t["name"] for t in summary["trials"]]
        expect = {"runs, best first": ["Model training", "shared view",
                                       "best/val/overall", summary["experiment"], *trials],
                  "this search": ["Model training", summary["experiment"], "Child runs",
                                  *trials]}
        for name, url in urls.items():
            shot = out / f"mlflow-{name.replace(' ', '-').replace(',', '')}.png"
            dom = browse(url, shot)
            missing = [text for text in expect[name] if text not in dom]
            ok = not missing and "GenAI overview" not in dom
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {url}  screenshot {shot}"
                  + (f"  missing: {missing}" if missing else ""))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
