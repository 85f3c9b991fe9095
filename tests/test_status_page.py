"""The status page (``GET /admin/ui``) in headless Chromium, against a running proxy.

The proxy runs in the test's event loop in front of two simulated replicas;
Selenium drives Debian's ``chromium`` through ``/usr/bin/chromedriver``
(Selenium's own driver manager never downloads anything here). Selenium
blocks, so every browser call runs in a worker thread while the loop keeps
serving the page's polls. Every wait is bounded; none is a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.sim import SimConfig, SimServer, start_sim
from tests.conftest import ProxyUnderTest
from tests.fleet import start_serve, write_config
from tests.helpers import KEY_A, KEY_B, make_config, wait_for
from tests.redis_server import RedisServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(
        "chromium and chromedriver not installed (scripts/test installs them as root with apt-get)",
        allow_module_level=True,
    )

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

Start = Callable[..., Awaitable[ProxyUnderTest]]
Driver = Any
CHAT = "/v1/chat/completions"
#: Fast probes, and an ejection that outlasts the test once it happens.
HEALTH = {"interval_ms": 100, "eject_after_failures": 1, "eject_ms": 60_000}
PAGE_WAIT_S = 30.0


@pytest.fixture
def driver() -> Iterator[Driver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1366,850"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
async def sims() -> AsyncIterator[list[SimServer]]:
    servers = [await start_sim(SimConfig(slots=4, decode_base_ms=5.0, seed=i)) for i in range(2)]
    try:
        yield servers
    finally:
        for server in servers:
            await server.close()


async def until(driver: Driver, condition: Callable[[Driver], Any]) -> Any:
    """Wait (bounded) for ``condition`` on the page, off the event loop."""

    def check(d: Driver) -> Any:
        try:
            return condition(d)
        except StaleElementReferenceException:  # the page re-rendered under us
            return False

    wait = WebDriverWait(driver, PAGE_WAIT_S, poll_frequency=0.2)
    return await asyncio.to_thread(wait.until, check)


def cell(driver: Driver, selector: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, selector).text)


def severe(driver: Driver) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


async def traffic(url: str, key: str, count: int) -> None:
    """``count`` chat requests, a few at a time; each must be answered 200."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    headers = {"Authorization": f"Bearer {key}"}
    limit = asyncio.Semaphore(4)

    async def one(session: aiohttp.ClientSession) -> None:
        async with limit, session.post(url + CHAT, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            await response.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(count)))


async def test_page_shows_tenants_replicas_traffic_ejection_and_drains(
    start_proxy: Start, sims: list[SimServer], driver: Driver
) -> None:
    """Loopback, no token: the page lists both tenants and replicas with their
    engine readings, shows the traffic it is sent, shows a replica whose port
    went away as ejected, and its Drain button (a real button, pressed with the
    keyboard) drains a replica, with no console error along the way."""
    replicas = [
        {"name": f"r{i}", "url": s.url, "max_concurrency": 4, "metrics_url": s.url + "/metrics"}
        for i, s in enumerate(sims)
    ]
    proxy = await start_proxy(make_config([], health=HEALTH, replicas=replicas))
    await wait_for(lambda: all(r.serving for r in proxy.runtime.pool.replicas), timeout_s=10)
    await asyncio.to_thread(driver.get, proxy.url + "/admin/ui")

    await until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-replica="r1"]'))
    for tenant in ("a", "b"):
        assert driver.find_element(By.CSS_SELECTOR, f'tr[data-tenant="{tenant}"]')
    for replica in ("r0", "r1"):
        assert cell(driver, f'tr[data-replica="{replica}"] td.state') == "serving"
    assert cell(driver, 'tr[data-tenant="a"] td.goodput') == "–"
    assert not driver.find_element(By.ID, "login").is_displayed()  # no token needed
    # The engines' own metrics, as the health loop last read them.
    await until(driver, lambda d: cell(d, 'tr[data-replica="r0"] td.engine').startswith("waiting"))

    # Traffic starts: the history the page reads counts it, and the page shows it.
    await traffic(proxy.url, KEY_A, 12)
    await traffic(proxy.url, KEY_B, 4)
    await until(driver, lambda d: cell(d, 'tr[data-tenant="a"] td.goodput').endswith("/s)"))
    await until(driver, lambda d: cell(d, 'tr[data-tenant="b"] td.goodput') != "–")
    assert cell(driver, 'tr[data-tenant="a"] td.refused') == "none"

    # r1's port refuses connections: the probes eject it, and the page says so.
    r0, r1 = proxy.runtime.pool.replicas
    await sims[1].refuse_for(None)
    await wait_for(lambda: r1.ejected, timeout_s=10)
    await until(driver, lambda d: cell(d, 'tr[data-replica="r1"] td.state') == "ejected")

    # Drain r0 from the keyboard: focus its button, press Enter.
    button = driver.find_element(By.ID, "act-r0")
    assert button.tag_name == "button" and button.text == "Drain"
    await asyncio.to_thread(button.send_keys, Keys.ENTER)
    await wait_for(lambda: r0.draining, timeout_s=10)
    await until(driver, lambda d: cell(d, 'tr[data-replica="r0"] td.state') == "draining")
    await until(driver, lambda d: d.find_element(By.ID, "act-r0").text == "Undrain")
    # Undrain by click.
    await asyncio.to_thread(driver.find_element(By.ID, "act-r0").click)
    await wait_for(lambda: not r0.draining, timeout_s=10)
    await until(driver, lambda d: cell(d, 'tr[data-replica="r0"] td.state') == "serving")

    assert severe(driver) == []


async def test_page_asks_for_the_token_and_keeps_it_out_of_the_url(
    start_proxy: Start, sims: list[SimServer], driver: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an admin token set, the page shows a password field; the token typed
    into it (Enter submits) is sent as the bearer header, the data appears, and
    the token never shows in the URL or local storage."""
    secret = "s3cret-admin-token"
    monkeypatch.setenv("ADMISSION_ADMIN_TOKEN", secret)
    proxy = await start_proxy(make_config([s.url for s in sims], health=HEALTH))
    await asyncio.to_thread(driver.get, proxy.url + "/admin/ui")

    field = await until(driver, lambda d: d.find_element(By.ID, "token"))
    await until(driver, lambda d: d.switch_to.active_element == field)
    assert field.get_attribute("type") == "password"
    assert not driver.find_elements(By.CSS_SELECTOR, "tr[data-tenant]")

    await asyncio.to_thread(field.send_keys, secret + Keys.ENTER)
    await until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-replica="r1"]'))
    assert driver.find_element(By.CSS_SELECTOR, 'tr[data-tenant="b"]')
    assert secret not in driver.current_url
    assert driver.execute_script("return window.localStorage.length") == 0
    assert severe(driver) == []

    # A wrong token (the session's copy replaced) brings the prompt back.
    await asyncio.to_thread(
        driver.execute_script,
        "sessionStorage.setItem('admission-proxy-admin-token', 'wrong'); location.reload()",
    )
    await until(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
    assert cell(driver, "#login-note") == "that token was refused"


async def test_page_shows_token_quota_use(
    start_proxy: Start, sims: list[SimServer], driver: Driver
) -> None:
    """A tenant with a day quota: its quota cell shows the tokens used today against the
    limit, as /admin/state counts them after its traffic; a tenant without one says so."""
    tenants = {
        "a": {"api_keys": [KEY_A], "token_quota": {"per_day": 100_000}},
        "b": {"api_keys": [KEY_B]},
    }
    proxy = await start_proxy(make_config([s.url for s in sims], tenants=tenants, health=HEALTH))
    await traffic(proxy.url, KEY_A, 4)
    await wait_for(lambda: not proxy.runtime.active, timeout_s=10)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/admin/state") as r:
        used = (await r.json())["tenants"]["a"]["quota"]["used"]
    assert used > 0
    await asyncio.to_thread(driver.get, proxy.url + "/admin/ui")
    await until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-tenant="a"]'))
    expected = f"{used} / 100000 tokens today"
    await until(driver, lambda d: cell(d, 'tr[data-tenant="a"] td.quota') == expected)
    assert cell(driver, 'tr[data-tenant="b"] td.quota') == "no quota"
    assert severe(driver) == []


async def test_page_shows_each_model_pool_whole(
    start_proxy: Start, sims: list[SimServer], driver: Driver
) -> None:
    """r0 serves llama and qwen, r1 only llama: the page has one section per pool
    (llama: r0 and r1; qwen: r0), each titled with its queue, not one per replica's
    list of models ("llama, qwen" was no pool and hid r0 from llama's section); r0's
    Drain button in its first section keeps its id and drains it."""
    replicas = [
        {"name": "r0", "url": sims[0].url, "max_concurrency": 4, "models": ["llama", "qwen"]},
        {"name": "r1", "url": sims[1].url, "max_concurrency": 4, "models": ["llama"]},
    ]
    proxy = await start_proxy(make_config([], health=HEALTH, replicas=replicas))
    await asyncio.to_thread(driver.get, proxy.url + "/admin/ui")
    await until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'div[data-pool="qwen"] tr'))

    def grouped(d: Driver) -> dict[str, list[str]]:
        """Each section's pool and its replicas' rows (read whole: the page re-renders)."""
        return {
            str(section.get_attribute("data-pool")): sorted(
                str(row.get_attribute("data-replica"))
                for row in section.find_elements(By.CSS_SELECTOR, "tbody tr")
            )
            for section in d.find_elements(By.CSS_SELECTOR, "div.pool")
        }

    expected = {"llama": ["r0", "r1"], "qwen": ["r0"]}
    await until(driver, lambda d: grouped(d) == expected)
    await until(driver, lambda d: cell(d, 'div[data-pool="qwen"] h3') == "qwen · 0 queued")
    await asyncio.to_thread(driver.find_element(By.ID, "act-r0").click)
    r0 = proxy.runtime.pool.get("r0")
    assert r0 is not None
    await wait_for(lambda: r0.draining, timeout_s=10)
    await until(
        driver,
        lambda d: cell(d, 'div[data-pool="qwen"] tr[data-replica="r0"] td.state') == "draining",
    )
    assert severe(driver) == []


@pytest.mark.redis
async def test_page_says_how_many_workers_its_figures_count(
    tmp_path: Path, upstream_url: str, redis_server: RedisServer, driver: Driver
) -> None:
    """``serve --workers 2``: the status line says both workers answered (the figures
    are the group's, whichever worker each poll reached: queue capacity 10 each)."""
    config = {
        "replicas": [{"name": "r0", "url": upstream_url, "max_concurrency": 4}],
        "tenants": {"a": {"api_keys": [KEY_A], "queue_capacity": 10}},
        "state": {"backend": "redis", "redis_url": redis_server.url},
    }
    proxy = await start_serve(write_config(tmp_path / "c.yaml", config), workers=2)
    try:
        await asyncio.to_thread(driver.get, proxy.url + "/admin/ui")
        await until(driver, lambda d: "· 2 workers" in cell(d, "#status"))
        assert "not answering" not in cell(driver, "#status")
        assert cell(driver, 'tr[data-tenant="a"] td.queued') == "0 / 20"
        assert severe(driver) == []
    finally:
        assert await proxy.stop() == 0
