"""The built docs site as a reader sees it: pages opened in headless Chromium.

Debian's ``chromium`` (installed here as root when missing, as ``.ci/run`` does) driven by
Playwright. Each page must render its heading, the site navigation and its code blocks, with
no error on the browser console. The screenshots are kept in the test's temporary folder
(``pytest --basetemp DIR`` to choose it).
"""

import functools
import os
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers.cli import tagged_processes
from helpers.docs_site import build_site

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

# as a root process on a machine without a display and with a closed network
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

PAGES = {  # path: (the page's heading, a line of text of its own)
    "": ("fedavg", "Train many, then merge."),
    "reference/cli/": ("Command line", "fedavg simulate [OPTIONS]"),
    "how-to/data/": ("Your own data", "scikit-learn's 1,797 8x8 digits"),
    "getting-started/": ("Getting started", "fedavg simulate --output runs/first"),
}


def chromium() -> str:
    """Return the path of Debian's chromium, installed first when missing (as root)."""
    path = shutil.which("chromium")
    if path:
        return path
    if os.geteuid() != 0:
        raise AssertionError("the browser test needs Debian's chromium (apt-get install "
                             "chromium, as root) or deselect it: pytest -m 'not browser'")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=900, check=True)
    return shutil.which("chromium")


@pytest.fixture(scope="module")
def served_site(tmp_path_factory):
    """Build the site into a temporary folder and serve it on 127.0.0.1 from a thread."""
    site = build_site(tmp_path_factory.mktemp("site"))
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request on the test's output
        pass


def test_pages_render_in_headless_chromium(served_site, tmp_path):
    from playwright.sync_api import sync_playwright

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            for path, (heading, text) in PAGES.items():
                _check_page(browser, served_site + path, heading, text,
                            shots / f"{path.strip('/').replace('/', '-') or 'home'}.png")
        finally:
            browser.close()
    assert sorted(p.name for p in shots.iterdir()) == sorted(
        f"{p.strip('/').replace('/', '-') or 'home'}.png" for p in PAGES)
    left = [p for p in tagged_processes("FEDAVG_TEST_SESSION", os.environ["FEDAVG_TEST_SESSION"])
            if "chrom" in p or "playwright" in p]
    assert not left, left


def _check_page(browser, url, heading, text, shot) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == 200, url
    assert heading in page.locator("article h1").first.inner_text(), url
    nav = page.locator("nav.md-nav--primary")
    assert nav.count() >= 1
    for entry in ("Getting started", "Command line", "Across machines"):
        assert nav.first.locator("a", has_text=entry).count() >= 1, (url, entry)
    code = page.locator("article pre code")
    assert code.count() >= 1 and code.first.is_visible(), url
    assert text in page.locator("article").inner_text(), url
    page.screenshot(path=str(shot))
    page.close()
    assert not errors, (url, errors)
