"""Open quantlab's HTML reports in headless Chromium and check what a reader would see.

    pip install playwright            # the Python driver only: it drives the system Chromium
    python benchmarks/report_html_chromium.py RUN_DIR [RUN_DIR ...] [--chromium /usr/bin/chromium]

For each run's `reports/report.html`, and for the `quantlab compare` page of all of them, the page
is loaded from disk with every network request recorded (and answered with an error): the page
must make none besides its own file and `data:` URIs, every <img> must have decoded (naturalWidth
> 0), and the tables must be there. A screenshot of each page goes next to the result.

Writes `benchmarks/results/report_html_chromium.{json,md}` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def check_page(browser: Any, page_path: Path, screenshot: Path) -> dict[str, Any]:
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    requested: list[str] = []

    def route(r: Any) -> None:
        url = r.request.url
        if url.startswith(("file://", "data:")) and (url.startswith("data:") or Path(url[7:]) == page_path):
            r.continue_()
        else:
            requested.append(url)
            r.abort()

    page.route("**/*", route)
    page.goto(page_path.resolve().as_uri(), wait_until="load")
    facts = page.evaluate("""() => ({
        title: document.title,
        images: document.images.length,
        images_decoded: [...document.images].filter(i => i.complete && i.naturalWidth > 0).length,
        tables: document.querySelectorAll('table').length,
        headings: [...document.querySelectorAll('h2')].map(h => h.textContent),
        scripts: document.scripts.length,
    })""")
    page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    ok = not requested and facts["images"] == facts["images_decoded"] > 0 and facts["tables"] > 0 and not facts["scripts"]
    return {"page": str(page_path), "ok": ok, "external_requests": requested, **facts,
            "screenshot": screenshot.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "report_html_chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from quantlab.compare import compare_rows
    from quantlab.report_html import compare_page

    shots = Path(tempfile.mkdtemp(prefix="report-shots-"))
    compare_html = shots / "compare.html"
    compare_html.write_text(compare_page(compare_rows(args.runs)), encoding="utf-8")
    pages = [run / "reports" / "report.html" for run in args.runs] + [compare_html]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        results = [check_page(browser, page, shots / f"{i}_{page.parent.parent.name or 'compare'}.png")
                   for i, page in enumerate(pages)]
        version = browser.version
        browser.close()
    out = {"chromium": version, "screenshots": str(shots), "pages": results, "all_ok": all(r["ok"] for r in results)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# HTML reports in headless Chromium {version}", "",
             "`python benchmarks/report_html_chromium.py RUN_DIR...`: each page loaded from disk with every network "
             "request recorded and refused.", "",
             "| page | ok | external requests | images decoded | tables | sections |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        page = Path(r["page"])
        name = page.name if page.parent.name != "reports" else f"{page.parent.parent.name}/reports/{page.name}"
        lines.append(f"| {name} | {'yes' if r['ok'] else 'NO'} | {len(r['external_requests'])} | "
                     f"{r['images_decoded']}/{r['images']} | {r['tables']} | {', '.join(r['headings'])} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
