"""The inspector page in a real headless Chromium (Debian's ``chromium``, driven by Playwright)
against a running server under load: the rendered DOM shows live numbers that change, and a
screenshot is saved under the test's tmp dir. The page sits behind the admin key."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from tests.server.conftest import start_server
from tests.sync import STATE_TIMEOUT_S

sync_api = pytest.importorskip("playwright.sync_api")

ADMIN = "admin-key"


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = shutil.which("chromium")
    assert path, "the browser test needs Debian's chromium: apt-get install chromium (.ci/run does)"
    return path


def test_dashboard_shows_live_numbers_under_load(llama_path, chromium_path, tmp_path):
    srv = start_server(llama_path, "--api-key", "user-key", "--admin-api-key", ADMIN)
    stop = threading.Event()

    def load() -> None:
        headers = {"Authorization": "Bearer user-key"}
        with httpx.Client(base_url=srv.base_url, headers=headers, timeout=120) as c:
            i = 0
            while not stop.is_set():
                c.post("/generate", json={"text": f"A shared prefix for the tree {i % 3}",
                                          "sampling_params": {"max_new_tokens": 24}})
                i += 1

    loaders = [threading.Thread(target=load) for _ in range(2)]
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as admin:
            admin.post("/slow_down", json={"forward_sleep_time": 0.02},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        for t in loaders:
            t.start()
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # Playwright's 30 s default is a deadline a loaded machine can miss: a failure bound.
            page.set_default_timeout(STATE_TIMEOUT_S * 1000)
            assert page.goto(f"{srv.base_url}/dashboard").status == 401
            assert page.goto(f"{srv.base_url}/dashboard?key=user-key").status == 401
            assert page.goto(f"{srv.base_url}/dashboard?key={ADMIN}").status == 200

            def number(element_id: str) -> int:
                return int(page.locator(f"#{element_id}").inner_text())

            page.wait_for_function(
                "() => /^\\d+$/.test(document.getElementById('steps').textContent)"
            )
            steps, tokens = number("steps"), number("generated-tokens")
            # The page polls on its own: the same DOM shows the counters move.
            page.wait_for_function(
                f"() => Number(document.getElementById('steps').textContent) > {steps} + 5"
                f" && Number(document.getElementById('generated-tokens').textContent) > {tokens}"
            )
            page.wait_for_function(
                "() => Number(document.getElementById('num-running').textContent) > 0"
            )
            page.wait_for_function(
                "() => Number(document.getElementById('tree').dataset.nodes) > 1"
            )
            assert page.locator("#kv-total").inner_text() == "4096"
            assert page.locator("#error").inner_text() == ""
            assert len(page.locator("#kv-used-line").get_attribute("points").split()) > 2
            assert "prefill" in page.locator("#mix").inner_text()
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            browser.close()
    except BaseException:
        srv.kill()
        raise
    finally:
        stop.set()
        for t in loaders:
            if t.is_alive() or t.ident is not None:
                t.join(120)
    srv.check_clean_stop()
