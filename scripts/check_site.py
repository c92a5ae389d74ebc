"""After `mkdocs build`: the built site works where a reader opens it, from disk, in a real browser.

`mkdocs build --strict` checks links and anchors in the Markdown; it cannot see what a browser shows. A first-time
user opened `site/index.html` from `file://` and met directory listings instead of pages, no search box, and code
cut off at the right edge of a 530 px column. This checks the built site for each, and keeps screenshots:

* every internal link of every page names a file that exists (`use_directory_urls: false`), never a directory;
* the offline search is wired: `search/search_index.js` exists, and the iframe-worker shim is the site's own file,
  not a CDN's (nothing outside the machine is reachable from CI);
* in headless Chromium, from `file://`, at 1280 x 900 and 1920 x 1080: no code block of the widest pages overflows
  its box, the content column is at least 700 px wide at 1280, table cells do not break words, and a search
  typed into the search box lists results;
* a PNG of each page and size, written to SITE/_screenshots/ (or --screenshots DIR), for a person to look at.

    python scripts/check_site.py site                   # what `make docs` runs
    python scripts/check_site.py site --no-browser      # the link and wiring checks only (no Chromium here)

Chromium: `apt-get install -y chromium` (`.ci/run` installs it when it is missing). It runs headless, sandboxed off
(CI runs as root), with a fresh profile, no GPU and no network services.
"""

from __future__ import annotations

import argparse
import html.parser
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: The pages whose code is widest (118-character lines, wide tables), and the search query that must find results.
PAGES = ["index.html", "vllm.html", "integrating.html", "hardening.html"]
SEARCH = "microbatch"
SIZES = [(1280, 900), (1920, 1080)]
MIN_CONTENT_PX = 700  # at 1280 px; 118 characters of Material's code font need about 830 px, wrapping does the rest
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--allow-file-access-from-files", "--virtual-time-budget=15000"]


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.scripts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"] or "")
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"] or "")


def link_problems(site: Path) -> list[str]:
    """Internal links that name a directory or a missing file; scripts loaded from another host."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        if "_screenshots" in page.parts or page.name.startswith("_check") or page.name == "404.html":
            continue  # 404.html is for a web server, whose root its absolute links name
        parser = _Links()
        parser.feed(page.read_text(errors="replace"))
        for href in parser.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or not parts.path:  # another site, or an anchor on this page
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                problems.append(f"{page.relative_to(site)}: link {href!r} is a directory (a listing from file://)")
            elif not target.exists():
                problems.append(f"{page.relative_to(site)}: link {href!r} names no file")
        for src in parser.scripts:
            if urlsplit(src).netloc:
                problems.append(f"{page.relative_to(site)}: script {src!r} comes from another host")
    if not (site / "search" / "search_index.js").is_file():
        problems.append("search/search_index.js is missing: search cannot run from file:// (the offline plugin)")
    return problems


#: Run in the page once it has loaded: measures what the reader sees, types a search, and leaves the results on
#: <body data-tbo-check="..."> for --dump-dom to carry out.
_PROBE = """
<script>
(function () {
  function measure() {
    var content = document.querySelector(".md-content");
    var blocks = Array.from(document.querySelectorAll(".md-typeset pre > code"));
    var overflowing = blocks.filter(function (c) { return c.scrollWidth > c.clientWidth + 1; })
      .map(function (c) { return c.textContent.split("\\n")[0].slice(0, 60); });
    var cells = Array.from(document.querySelectorAll(".md-typeset table:not([class]) td"));
    // a key in a cell (inline code) whose line breaks between two word characters (token_distribu|tion) was cut
    // inside a word; a break after a hyphen, a comma or a space is an ordinary one
    function cutInsideAWord(c) {
      var node = c.firstChild, range = document.createRange(), top = null;
      if (!node || node.nodeType !== 3 || c.getClientRects().length < 2) { return false; }
      for (var i = 0; i < node.textContent.length; i++) {
        range.setStart(node, i); range.setEnd(node, i + 1);
        var box = range.getClientRects()[0];
        if (!box) { continue; }
        if (top !== null && box.top > top + 2 && /\\w/.test(node.textContent[i - 1]) &&
            /\\w/.test(node.textContent[i])) { return true; }
        top = box.top;
      }
      return false;
    }
    var broken = Array.from(document.querySelectorAll(".md-typeset table:not([class]) td code"))
      .filter(cutInsideAWord).map(function (c) { return c.textContent; });
    return {content_px: content ? Math.round(content.getBoundingClientRect().width) : 0,
            code_blocks: blocks.length, overflowing: overflowing, cells: cells.length, cells_breaking_words: broken};
  }
  function search(done) {
    var input = document.querySelector("[data-md-component=search-query]");
    if (!input) { done(-1); return; }
    var tries = 0;
    input.focus();
    input.value = "%(query)s";
    input.dispatchEvent(new Event("input", {bubbles: true}));
    (function wait() {  // the index loads in the worker's iframe: give it up to 10 s
      setTimeout(function () {
        var n = document.querySelectorAll(".md-search-result__item").length;
        if (n > 0 || ++tries > 20) { done(n); } else { wait(); }
      }, 500);
    })();
  }
  window.addEventListener("load", function () {
    setTimeout(function () {
      var found = measure();
      search(function (n) {
        found.search_results = n;
        document.body.setAttribute("data-tbo-check", JSON.stringify(found));
      });
    }, 500);
  });
})();
</script>
"""


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _chromium(browser: str, profile: Path, size: tuple[int, int], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                           f"--window-size={size[0]},{size[1]}", *args], capture_output=True, text=True,
                          timeout=120)


def browser_problems(site: Path, shots: Path, browser: str) -> tuple[list[str], list[str]]:
    """(problems, what was measured) for each page and window size, from file://, with a screenshot of each."""
    problems, report = [], []
    shots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tbo-chromium-") as tmp:
        for name in PAGES:
            page = site / name
            if not page.is_file():
                problems.append(f"{name}: not built")
                continue
            probe = page.with_name(f"_check_{page.name}")  # beside the page, so its relative links resolve
            probe.write_text(page.read_text().replace("</body>", _PROBE % {"query": SEARCH} + "</body>", 1))
            try:
                for size in SIZES:
                    label = f"{name} at {size[0]}x{size[1]}"
                    profile = Path(tmp) / f"profile-{page.stem}-{size[0]}"
                    png = shots / f"{page.stem}-{size[0]}x{size[1]}.png"
                    _chromium(browser, profile, size, f"--screenshot={png}", page.resolve().as_uri())
                    if not png.is_file():
                        problems.append(f"{label}: Chromium wrote no screenshot")
                    out = _chromium(browser, profile, size, "--dump-dom", probe.resolve().as_uri())
                    start = out.stdout.find('data-tbo-check="')
                    if start < 0:
                        problems.append(f"{label}: the probe did not finish (Chromium said: {out.stderr[-300:]})")
                        continue
                    raw = out.stdout[start + len('data-tbo-check="'):].split('"', 1)[0]
                    found = json.loads(html.unescape(raw))
                    report.append(f"{label}: content {found['content_px']} px, {found['code_blocks']} code blocks, "
                                  f"{len(found['overflowing'])} overflowing, {found['cells']} table cells, "
                                  f"search {SEARCH!r}: {found['search_results']} results")
                    if found["overflowing"]:
                        problems.append(f"{label}: code runs past the edge: {found['overflowing'][:3]}")
                    if size == SIZES[0] and found["content_px"] < MIN_CONTENT_PX:
                        problems.append(f"{label}: the content column is {found['content_px']} px wide "
                                        f"(< {MIN_CONTENT_PX})")
                    if found["cells_breaking_words"]:
                        problems.append(f"{label}: table keys broken inside the word: "
                                        f"{found['cells_breaking_words'][:3]}")
                    if found["search_results"] < 1:
                        problems.append(f"{label}: searching {SEARCH!r} from file:// found nothing "
                                        f"({found['search_results']})")
            finally:
                probe.unlink()
    return problems, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build -d SITE)")
    parser.add_argument("--screenshots", type=Path, default=None,
                        help="where the PNGs go (default SITE/_screenshots)")
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium checks")
    args = parser.parse_args(argv)
    site = args.site
    if not (site / "index.html").is_file():
        print(f"check_site: {site} holds no built site (run mkdocs build first)", file=sys.stderr)
        return 2
    problems = link_problems(site)
    report: list[str] = []
    if not args.no_browser:
        browser = find_browser()
        if browser is None:
            print("check_site: no Chromium found (apt-get install -y chromium), or pass --no-browser",
                  file=sys.stderr)
            return 2
        found, report = browser_problems(site, args.screenshots or site / "_screenshots", browser)
        problems += found
    for line in report:
        print(line)
    for line in problems:
        print(f"check_site: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_site: {site} is browsable from file://"
          + ("" if args.no_browser else f"; screenshots in {args.screenshots or site / '_screenshots'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
