"""Open every page of the built book in headless Chromium and fail on what a reader would see as broken.

    python book/tools/site_check.py [--html _build/html] [--require]

Uses the Chromium of the system packages (never a downloaded browser build), driven by Playwright. Checks each
page for: JavaScript errors; an empty widget area; an image wider than the content column, or a figure shrunk
so far that its text renders under 9 pt; a table wider than it
that no scroll container holds; a temporary path or an internal '(target >= ...)' string; a raw glue box (a value
glued for the prose but shown in a box); an internal link to a page or anchor that does not exist. Saves a
full-page screenshot of each under _build/screenshots/.
Without Chromium it says how to install it and skips (exit 0), or fails with --require (CI).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# nanodist.plots draws figures at 100 dpi with no text under 9 pt: at 100 % a 9 pt font shows as 9.4 CSS pt, so a
# figure may be shrunk to 96 % before its smallest text falls under 9 pt.
MIN_SCALE = 0.96

# Runs in the page: every problem the page shows, as strings.
PAGE_CHECKS = r"""
(MIN_SCALE) => {
  const problems = [];
  const column = document.querySelector("main article, .bd-article, article, main") || document.body;
  const width = column.getBoundingClientRect().width;
  const scrolls = el => { for (let p = el; p && p !== column.parentElement; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX; if (o === "auto" || o === "scroll") return true; } return false; };
  for (const img of column.querySelectorAll("img")) {
    const w = img.getBoundingClientRect().width;
    if (w > width + 1) problems.push(`image ${img.getAttribute("src")} is ${Math.round(w)} px wide, the column ${Math.round(width)} px`);
    if (img.complete && img.naturalWidth === 0) problems.push(`image ${img.getAttribute("src")} did not load`);
    // A figure is drawn with text of at least 9 pt at 100 dpi (nanodist.plots); shown below MIN_SCALE of its size,
    // that text would render under 9 pt.
    if (img.closest(".cell_output") && img.naturalWidth > 0 && w > 0 && w / img.naturalWidth < MIN_SCALE)
      problems.push(`figure ${img.getAttribute("src")} is shrunk to ${Math.round(100 * w / img.naturalWidth)}% ` +
                    `(${img.naturalWidth} px into ${Math.round(w)} px): its text renders below 9 pt; draw it narrower`);
  }
  for (const t of column.querySelectorAll("table")) {
    const w = t.getBoundingClientRect().width;
    if (w > width + 1 && !scrolls(t)) problems.push(`a table is ${Math.round(w)} px wide, the column ${Math.round(width)} px, and nothing scrolls it`);
  }
  for (const w of column.querySelectorAll(".widget-area, .jupyter-widgets, .jp-OutputArea-output .widget-subarea")) {
    const r = w.getBoundingClientRect();
    if (r.height < 2 || !w.textContent.trim() && !w.querySelector("img, canvas, svg, input, button")) problems.push("an empty widget area");
  }
  for (const s of column.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
    const out = s.closest(".cell_output, .output") || s.parentElement;
    const shown = out && [...out.children].some(c => c !== s && c.getBoundingClientRect().height > 2);
    if (!shown) problems.push("a Jupyter widget with nothing rendered in its place (no widget manager, no fallback)");
  }
  const text = column.innerText;
  for (const [pattern, what] of [[/\/tmp\/[\w.-]+/, "a temporary path"], [/\(target\s*[<>]=?/, "an internal target string"]]) {
    const m = text.match(pattern);
    if (m) problems.push(`${what} in the page: ${m[0]}`);
  }
  return problems;
}
"""


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def toc_files() -> list[str]:
    """The book's pages, in the order of book/_toc.yml."""
    import yaml
    toc = yaml.safe_load((ROOT / "book" / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        files += [c["file"] for c in part["chapters"]]
    return files


def glue_boxes(name: str) -> list[str]:
    """A notebook's glued values shown as outputs: a number in a box, where the prose should read it (display=False
    and a {glue:text} role)."""
    import json
    nb = ROOT / "book" / f"{name}.ipynb"
    if not nb.exists():
        return []
    out = []
    for cell in json.loads(nb.read_text())["cells"]:
        for o in cell.get("outputs", []):
            glued = o.get("metadata", {}).get("scrapbook")
            if glued and not glued.get("mime_prefix"):
                out.append(f"a raw glue box: glue({glued.get('name')!r}) shows its value (glue it with display=False)")
    return out


def link_problems(page: Path, html: Path, anchors: dict[Path, set[str]]) -> list[str]:
    from html.parser import HTMLParser

    class Links(HTMLParser):
        def __init__(self):
            super().__init__()
            self.hrefs = []

        def handle_starttag(self, tag, attrs):
            href = dict(attrs).get("href")
            if tag == "a" and href:
                self.hrefs.append(href)

    parser = Links()
    parser.feed(page.read_text())
    out = []
    for href in parser.hrefs:
        parts = urlsplit(href)
        if parts.scheme or href.startswith(("mailto:", "javascript:", "//")):
            continue
        target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            shown = target.relative_to(html.resolve()) if html.resolve() in target.parents else target
            out.append(f"broken link {href}: {shown} does not exist")
            continue
        if parts.fragment and target.suffix == ".html":
            if target not in anchors:
                anchors[target] = _ids(target)
            if unquote(parts.fragment) not in anchors[target]:
                out.append(f"broken link {href}: no #{parts.fragment} in {target.name}")
    return out


def _ids(page: Path) -> set[str]:
    import re
    return set(re.findall(r"""\bid=["']([^"']+)["']""", page.read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    ap.add_argument("--require", action="store_true", help="fail (not skip) when Chromium is missing")
    args = ap.parse_args()
    browser = find_browser()
    if browser is None:
        msg = ("site check: no Chromium found (looked for " + ", ".join(BROWSERS) + "). Install the system's "
               "package, e.g. `sudo apt-get install chromium` on Debian/Ubuntu or `brew install --cask chromium` on "
               "macOS; the check never downloads a browser.")
        print(msg + (" Failing: --require." if args.require else " Skipping."), file=sys.stderr)
        return 1 if args.require else 0
    html = args.html
    if not (html / "index.html").exists():
        print(f"site check: no built book in {html}: run `python3 dev.py book --cached` first", file=sys.stderr)
        return 1
    shots = html.parent / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    problems: dict[str, list[str]] = {}
    anchors: dict[Path, set[str]] = {}
    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=browser, headless=True, args=["--no-sandbox"])
        page = chrome.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(f"JavaScript error: {e}"))
        for name in toc_files():
            p = html / f"{name}.html"
            if not p.exists():
                problems[p.name] = [f"{name} is in book/_toc.yml but was not built"]
                continue
            errors.clear()
            page.goto(p.resolve().as_uri(), wait_until="load")
            page.wait_for_timeout(300)
            found = [*errors, *page.evaluate(PAGE_CHECKS, MIN_SCALE), *link_problems(p, html, anchors), *glue_boxes(name)]
            page.screenshot(path=str(shots / f"{p.stem}.png"), full_page=True)
            if found:
                problems[p.name] = found
            print(f"{'FAIL' if found else 'ok  '} {p.name}" + (f": {len(found)} problem(s)" if found else ""))
        chrome.close()
    for name, found in problems.items():
        for f in found:
            print(f"  {name}: {f}")
    print(f"screenshots in {shots}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
