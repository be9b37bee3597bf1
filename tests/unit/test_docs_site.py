"""The documentation site and its coverage: mkdocs.yml builds with ``--strict`` (every page in the
navigation, every link, anchor and API reference resolved), the built site looks right in a real browser
(headless Chromium: a screenshot and the rendered page of the home page and of one API page), the API
reference documents every public name of ``towers``, and every Python block of the Markdown runs in the
doc tests or says why not."""

from __future__ import annotations

import functools
import html.parser
import importlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import types
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

import towers
from cli_support import clean_env
from doc_blocks import ROOT, markdown_files, python_blocks

_SITE_PACKAGES = ("mkdocs", "material", "mkdocstrings_handlers.python")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with ``mkdocs build --strict``."""
    missing = [name for name in _SITE_PACKAGES if not _importable(name)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install '.[docs]' (make install installs it)")
    site = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=ROOT, env=clean_env({"NO_MKDOCS_2_WARNING": "1"}),
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return site


@pytest.mark.timeout(300)
def test_the_site_builds_with_strict(site):
    assert (site / "index.html").is_file() and (site / "api" / "strategies" / "index.html").is_file()


# --- The site in a browser -------------------------------------------------------------------------------------------
# Debian's chromium, which `make test` installs as root (the Makefile's `chromium` target). Material's search runs in a
# web worker that file:// pages may not start, so the site is served over http on the loopback, as a reader gets it.
_CHROMIUM_NAMES = ("chromium", "chromium-browser")
_WINDOW = (1280, 900)


def _chromium() -> str:
    """The chromium executable; skips (with the reason) where it cannot be had, fails where it could be installed."""
    for name in _CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get): "
                    "apt-get install -y chromium to check the site in a browser")
    pytest.fail("chromium is not installed. Run `make chromium` (make test does it first) or "
                "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over http on 127.0.0.1 (a free port); yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, name="docs-site-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _run_chromium(chromium: str, profile: Path, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """One headless chromium run in its own session; the whole process group is killed if it outlives timeout_s."""
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--window-size={_WINDOW[0]},{_WINDOW[1]}", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"chromium did not finish within {timeout_s}s: {' '.join(flags)}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class _Page(html.parser.HTMLParser):
    """What a reader sees of a rendered page: its title, its links (href, class, text) and its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.title = ""
        self.links: list[tuple[str, str, str]] = []
        self.inputs: list[dict[str, str]] = []
        self.classes: set[str] = set()
        self._in_title = False
        self._link: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {key: value or "" for key, value in attrs}
        self.classes.update(values.get("class", "").split())
        if tag == "title":
            self._in_title = True
        elif tag == "a":
            self._link = [values.get("href", ""), values.get("class", ""), ""]
        elif tag == "input":
            self.inputs.append(values)

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag == "a" and self._link is not None:
            self.links.append((self._link[0], self._link[1], " ".join(self._link[2].split())))
            self._link = None

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._link is not None:
            self._link[2] += data


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return _chromium(), tmp_path_factory.mktemp("chromium-profile")


def _rendered(browser: tuple[str, Path], url: str) -> _Page:
    done = _run_chromium(*browser, "--dump-dom", url)
    assert done.returncode == 0 and "</html>" in done.stdout, f"chromium --dump-dom {url} failed:\n{done.stderr[-3000:]}"
    page = _Page()
    page.feed(done.stdout)
    return page


def _screenshot(browser: tuple[str, Path], url: str, png: Path) -> None:
    done = _run_chromium(*browser, f"--screenshot={png}", url)
    assert done.returncode == 0 and png.is_file(), f"chromium --screenshot {url} failed:\n{done.stderr[-3000:]}"
    from PIL import Image  # pillow comes with matplotlib, a test dependency

    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == _WINDOW, f"{png}: {image.format} {image.size}"
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 16) or []
        # A page that failed to load or to style is one or two colours; the site has text, code and a coloured header.
        assert len(colours) >= 16, f"{url} looks blank: {len(colours)} colours in {png}"
        body = max(colours)[1]
        header = max(rgb.crop((0, 0, _WINDOW[0], 40)).getcolors(maxcolors=1 << 16) or [(0, body)])[1]
        assert header != body, f"{url}: the header has the page's own colour {body}: the theme's stylesheet did not load"


def _check_navigation_and_search(page: _Page, url: str) -> None:
    nav = {href.split("#")[0].rstrip("/").rsplit("/", 1)[-1] for href, cls, _ in page.links if "md-nav__link" in cls}
    for target in ("getting_started", "strategies", "checkpoints", "cli"):
        assert target in nav, f"{url}: no navigation link to {target}/ among {sorted(nav)}"
    search = [box for box in page.inputs if "md-search__input" in box.get("class", "").split()]
    assert search and search[0].get("placeholder") == "Search", f"{url}: no search box (input.md-search__input)"


@pytest.mark.timeout(180)
def test_the_home_page_renders_with_navigation_and_search(served, browser, tmp_path):
    _screenshot(browser, served, tmp_path / "home.png")
    page = _rendered(browser, served)
    assert page.title.strip() == "Home - towers", page.title
    _check_navigation_and_search(page, served)
    assert "md-content" in page.classes and "md-header" in page.classes, "the Material layout did not render"
    # The search box has something to search: the index the worker fetches over http names the API.
    with urllib.request.urlopen(served + "search/search_index.json", timeout=10) as response:
        assert b"MirroredStrategy" in response.read()


@pytest.mark.timeout(180)
def test_an_api_page_renders_the_docstrings(served, browser, tmp_path):
    url = served + "api/strategies/"
    _screenshot(browser, url, tmp_path / "api.png")
    page = _rendered(browser, url)
    assert page.title.strip() == "Strategies - towers", page.title
    _check_navigation_and_search(page, url)
    assert "doc-heading" in page.classes, f"{url}: no mkdocstrings entry rendered"
    anchors = {href for href, _, _ in page.links}
    assert {"#towers.strategies.MirroredStrategy", "#towers.strategies.strategy_from_env"} <= anchors, (
        f"{url}: the reference lacks MirroredStrategy or strategy_from_env")


def _resolve(path: str) -> object:
    """The object a ``::: a.b.c`` line names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ImportError(path)


def test_the_api_reference_documents_every_public_name():
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    documented = [_resolve(path) for path in re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.MULTILINE)]
    missing = []
    for name in towers.__all__:
        if name == "__version__":
            if "towers.__version__" not in text:
                missing.append(name)
            continue
        value = getattr(towers, name)
        # A `::: towers.data` entry documents the module and the members of its __all__ (towers.Shards among them).
        if not any(value is entry or (isinstance(entry, types.ModuleType) and name in getattr(entry, "__all__", ())
                                      and getattr(entry, name) is value) for entry in documented):
            missing.append(name)
    assert not missing, f"docs/api/*.md has no `::: ...` entry for towers.{', towers.'.join(missing)}"


_FENCE = re.compile(r"^```(\S*)\s*$")
# Languages a reader takes for Python; the doc tests run only ```python (and ```py) blocks.
_PYTHON_LIKE = {"python3", "py3", "pycon", "ipython", "python-repl"}
_LOOKS_LIKE_PYTHON = re.compile(r"^\s*(import \w|from [\w.]+ import |def \w+\(|class \w+[(:])", re.MULTILINE)


def _unlabelled_or_misnamed_python(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        lang, body = fence.group(1).lower(), "\n".join(lines[i + 1:j])
        if lang in _PYTHON_LIKE or (lang == "" and _LOOKS_LIKE_PYTHON.search(body)):
            found.append(f"{path.relative_to(ROOT)}:{i + 1} (```{lang})")
        i = j + 1
    return found


def test_every_python_block_runs_or_says_why_not():
    """tests/unit/test_docs.py runs every ```python block of README.md and docs/ that is not marked
    ``<!-- not-run: REASON -->``; a Python block under another fence would be skipped without a word."""
    hidden = [entry for path in markdown_files() for entry in _unlabelled_or_misnamed_python(path)]
    assert not hidden, f"Python blocks the doc tests would not run (fence them as ```python, or mark them not-run): {hidden}"
    for path in markdown_files():
        for block in python_blocks(path):
            assert block.mark != "not-run" or block.reason.strip(), f"{block.name}: <!-- not-run: REASON --> needs a reason"
