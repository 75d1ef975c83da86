"""The planner page in a real browser: headless Chromium from the OS packages, driven by Playwright's
Python API (its own browser downloads are never used). Types a query, reads the ranked table and the
launch command, follows a model to its plans, downloads a file, and opens the `--html` file offline.

Needs Chromium (`apt-get install chromium`; skipped, saying so, where .ci/run could not install it)
and Playwright (the test extra). FINETUNE_PAGE_SCREENSHOT=path.png saves a screenshot of the page (the picture in
README and docs/planner.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
from helpers import REPO
from playwright import sync_api

from finetune.cli.plan import page_answer
from finetune.models import catalog as model_catalog
from finetune.plan import serve

CHROMIUM = os.environ.get("FINETUNE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# no sandbox (containers run as root), no GPU, and nothing that calls home
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
QUERY = "what fits on 2×A100 40GB"

if CHROMIUM is None:
    pytest.skip("no Chromium installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def base_url():
    server = serve.start("127.0.0.1", 0, page_answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as playwright:
        # a fresh profile per run: no state from earlier runs or other browsers
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1366, "height": 768}, accept_downloads=True)  # a laptop screen
        yield context
        context.close()


@pytest.fixture
def page(browser):
    page = browser.new_page()
    problems = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    yield page
    page.close()
    assert not problems, problems  # no JavaScript errors


def best_plan(query: str, model: str) -> str:
    """How the page names `model`'s recommended plan for `query`, from `finetune plan --json` (the terminal's answer)."""
    from finetune.config.names import STRATEGIES

    done = subprocess.run([sys.executable, "-m", "finetune", "plan", query, "--json"], capture_output=True, text=True, check=True)
    entry = next(e for e in json.loads(done.stdout) if e["model"]["name"] == model)
    best = entry["plans"][entry["recommended"]]
    offload = "" if best["offload"] == "none" else f" + {best['offload']} offload"
    return f"{best['method']} {STRATEGIES[best['strategy']].label}{offload}"


def test_typing_a_query_shows_the_ranked_table_and_a_launch_command(base_url, page):
    page.goto(base_url + "?q=llama-7b+lora+on+1xA10G")
    page.wait_for_selector("#plans td.why")  # one model: its plans, each with why it lost
    query = page.locator("#q")
    query.fill("")
    query.press_sequentially(QUERY, delay=5)
    page.wait_for_selector("#plans th:has-text('methods that fit')")
    rows = page.locator("#plans tbody tr")
    assert rows.count() == len(model_catalog.REAL_MODELS) == len(model_catalog.MODELS) - 2  # the CPU demos aside
    assert "llama-2-70b" in rows.nth(3).inner_text() and best_plan(QUERY, "llama-2-70b") in rows.nth(3).inner_text()
    assert page.locator("#launch").inner_text().startswith("accelerate launch --config_file plan/")
    assert "q=what+fits+on+2%C3%97A100+40GB" in page.url  # the link holds the query
    hours = rows.nth(3).locator("td").nth(6)
    assert hours.inner_text() == "–"
    page.locator("#tokens").fill("1e9")  # hours and $ need a token count
    sync_api.expect(hours).not_to_have_text("–")  # (wait_for_function would need eval, which the page's CSP forbids)
    estimate, likely_range = hours.inner_text().replace(",", "").split("\n")  # the estimate, then its likely range
    low, high = (float(end) for end in likely_range.split("–"))
    assert 0 < low < float(estimate) < high
    if os.environ.get("FINETUNE_PAGE_SCREENSHOT"):
        rows.nth(3).click()
        page.screenshot(path=os.environ["FINETUNE_PAGE_SCREENSHOT"], full_page=True)

    rows.nth(3).locator("button:has-text('all plans')").click()  # one model's ranked plans
    page.wait_for_selector("#plans th:has-text('why')")
    assert page.locator("#plans tbody tr.recommended").count() == 1
    assert page.locator("#plans tbody tr.recommended td").first.inner_text() == "★"
    assert "--model llama-2-70b" in page.locator("#launch").inner_text()
    assert page.locator("#plans tbody tr.nofit").count() >= 1
    assert "model=llama-2-70b" in page.url and "tokens=1e9" in page.url


def test_errors_show_beside_the_field_and_files_download(base_url, page, tmp_path):
    page.goto(base_url + "?q=llama-2-13b+full+on+8xH100+zero3")
    page.wait_for_selector("#plans td.why")
    with page.expect_download() as download:
        page.locator("button:has-text('ds_config.json')").click()
    saved = tmp_path / "ds_config.json"
    download.value.save_as(saved)
    assert '"stage": 3' in saved.read_text()
    page.locator("#seq_len").fill("0")
    error = page.locator('[data-error="seq_len"]')
    error.filter(has_text="must be ≥ 1").wait_for()
    assert "--seq-len must be ≥ 1, got 0" in error.inner_text()
    assert "bad" in page.locator('[data-field="seq_len"]').get_attribute("class")


def test_html_file_renders_offline(page, tmp_path):
    html = tmp_path / "plan.html"
    subprocess.run([sys.executable, "-m", "finetune", "plan", "llama-70b qlora on 2x RTX 4090", "--html", str(html)],
                   check=True, capture_output=True, env=os.environ | {"PYTHONPATH": str(REPO)}, timeout=120)
    requested = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(html.as_uri())
    page.wait_for_selector("#plans td.why")
    assert "--model llama-2-70b --method qlora" in page.locator("#launch").inner_text()
    assert not page.locator("#form").is_visible()  # a snapshot: no form to change
    assert all(url.startswith(("file:", "data:")) for url in requested), requested
