"""The dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver,
installed by scripts/test.sh) driven by Selenium, against a real service on loopback that learns
from real CIFAR-10 images while the page watches."""

import shutil
import time

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from clients.api import ServiceClient

from .test_online import two_classes, wait_trained
from .test_service import Server

if shutil.which("chromedriver") is None:
    pytest.fail("chromedriver is missing: scripts/test.sh installs Debian's chromium and chromium-driver")


def chromium(width=1400, height=1800):
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def counter(driver, name):
    return driver.find_element(By.CSS_SELECTOR, f'.counter[data-name="{name}"] b').text


def wait(driver, condition, timeout=90):
    # the page re-renders its parts every refresh: an element found a moment ago may be gone
    return WebDriverWait(driver, timeout, poll_frequency=0.2,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(lambda d: condition(d))


def test_dashboard_follows_a_learning_stream(browser, tmp_path):
    server = Server(tmp_path / "svc", method="er", mem_size=40, history_every_steps=2).start()
    try:
        browser.get(server.url + "/")
        wait(browser, lambda d: counter(d, "samples trained") == "0")
        assert browser.find_element(By.ID, "state").text == "idle · er + ace"  # nothing to learn; ASER_LOSS's default
        assert browser.find_element(By.ID, "login").get_attribute("hidden") is not None  # no token needed
        # nothing comes from the internet: every script and style is the service's own
        for element in browser.find_elements(By.CSS_SELECTOR, "script[src], link[href]"):
            src = element.get_attribute("src") or element.get_attribute("href")
            assert src.startswith(server.url + "/dashboard/static/"), src

        samples = two_classes(150)
        with ServiceClient(server.url) as client:
            client.stream_samples(samples)
            wait_trained(client, len(samples))
        wait(browser, lambda d: counter(d, "samples trained") == "300")
        assert counter(browser, "classes") == "2" and counter(browser, "backlog") == "0"
        assert counter(browser, "lean steps (on)") == "0"  # er's default, none taken: it kept up
        scored, unscored = map(int, counter(browser, "samples scored / unscored").split(" / "))
        assert 280 <= scored <= 300 and unscored == 0  # no sleep's top answers: every batch scored
        accuracy = browser.find_element(By.ID, "chart-accuracy")
        wait(browser, lambda d: int(accuracy.get_attribute("data-points")) > 50)
        legend = browser.execute_script("return document.querySelector('#chart-accuracy .legend').innerText")
        assert "airplane" in legend and "frog" in legend
        # each legend swatch is drawn as its line is: the dashed cumulative line has a dashed swatch
        swatches = browser.execute_script(
            "return [...document.querySelectorAll('#chart-accuracy .legend span')].map(s => [s.dataset.series, "
            "s.querySelector('line').getAttribute('stroke'), s.querySelector('line').getAttribute('stroke-dasharray')])")
        paths = browser.execute_script(
            "return [...document.querySelectorAll('#chart-accuracy path')].map(p => [p.querySelector('title')"
            ".textContent, p.getAttribute('stroke'), p.getAttribute('stroke-dasharray')])")
        assert [s for s in swatches if s[0] in ("recent window", "cumulative")] == \
            [p for p in paths if p[0] in ("recent window", "cumulative")]
        assert swatches[0][1] != swatches[1][1] and swatches[1][2] == "4 3"
        # swatches keep their 22x8 box (the charts' own svg rule does not size them), and no card is
        # taller than its chart and legend need
        boxes = browser.execute_script("return [...document.querySelectorAll('.legend svg')].map(s => "
                                       "[s.getBoundingClientRect().width, s.getBoundingClientRect().height])")
        assert boxes and all(abs(w - 22) < 1 and abs(h - 8) < 1 for w, h in boxes), boxes
        heights = browser.execute_script("return [...document.querySelectorAll('.chart')].map(c => "
                                         "c.getBoundingClientRect().height)")
        assert heights and max(heights) < 420, heights
        # the rates have their own axis (the backlog its own chart), and a burst shows before any
        # point is stored for it
        assert int(browser.find_element(By.ID, "chart-rates").get_attribute("data-points")) > 0
        assert int(browser.find_element(By.ID, "chart-backlog").get_attribute("data-points")) > 0
        assert "backlog" not in browser.find_element(By.CSS_SELECTOR, "#chart-rates .legend").text
        assert int(browser.find_element(By.ID, "chart-step").get_attribute("data-points")) > 0
        assert int(browser.find_element(By.ID, "chart-replay").get_attribute("data-points")) > 0
        bars = browser.execute_script("return [...document.querySelectorAll('#memory-bars .bar')]"
                                      ".map(b => b.dataset.label)")
        assert set(bars) == {"airplane", "frog"}
        # a snapshot was exported when the classes appeared; its row links to the file
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#snapshots a.download"))

        # the predict box: pick a real image, see the top-k
        image = tmp_path / "frog.jpg"
        image.write_bytes(next(data for label, data in two_classes(200)[-20:] if label == "frog"))
        browser.find_element(By.ID, "predict-file").send_keys(str(image))
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#predict-result li"))
        top = browser.execute_script("return [...document.querySelectorAll('#predict-result li b')]"
                                     ".map(b => b.innerText)")
        assert set(top) == {"airplane", "frog"}

        # the memory browser: the images the memory holds for a class, as served by /memory
        memory = httpx.get(server.url + "/memory").json()
        Select(browser.find_element(By.ID, "memory-class")).select_by_value("frog")
        box = browser.find_element(By.ID, "memory-images")
        wait(browser, lambda d: box.get_attribute("data-label") == "frog")
        widths = "return [...document.querySelectorAll('#memory-images img')].map(i => i.naturalWidth)"
        wait(browser, lambda d: d.execute_script(widths) == [32] * memory["per_class"]["frog"])
    finally:
        server.stop()


def test_rates_show_a_first_burst_and_break_at_idle_gaps(browser, tmp_path):
    server = Server(tmp_path / "svc", method="er", mem_size=40, history_every_steps=100000).start()
    try:
        browser.get(server.url + "/")
        wait(browser, lambda d: counter(d, "samples trained") == "0")
        with ServiceClient(server.url) as client:  # a burst before any history point is stored
            client.stream_samples(two_classes(20))
            wait_trained(client, 40)
        rates = browser.find_element(By.ID, "chart-rates")
        wait(browser, lambda d: int(rates.get_attribute("data-points")) > 0)
        assert httpx.get(server.url + "/history").json() == []
        # the rate between two points is not averaged over an idle gap: the line breaks there
        computed = browser.execute_script(
            "return rates([{at: 0, received: 0, samples_trained: 0}, {at: 10, received: 100, samples_trained: 90},"
            " {at: 3600, received: 110, samples_trained: 100}], 'received')")
        assert computed == [[90, 10], [100, None]]
    finally:
        server.stop()


def test_dashboard_asks_for_the_read_token(browser, tmp_path):
    server = Server(tmp_path / "svc", method="er", read_token="r-secret", write_token="w-secret").start()
    try:
        browser.get(server.url + "/dashboard")
        login = wait(browser, lambda d: d.find_element(By.ID, "login") if d.find_element(By.ID, "login").is_displayed()
                     else None)
        assert not browser.find_element(By.ID, "board").is_displayed()
        assert browser.find_elements(By.CSS_SELECTOR, ".counter") == []  # nothing was read

        login.find_element(By.ID, "token").send_keys("wrong")
        login.find_element(By.TAG_NAME, "button").click()
        wait(browser, lambda d: "refused" in d.find_element(By.ID, "login-error").text)

        token = login.find_element(By.ID, "token")
        token.clear()
        token.send_keys("r-secret")
        login.find_element(By.TAG_NAME, "button").click()
        wait(browser, lambda d: d.find_element(By.ID, "board").is_displayed())
        wait(browser, lambda d: counter(d, "samples trained") == "0")
        time.sleep(0.5)
        assert not browser.find_element(By.ID, "login").is_displayed()
    finally:
        server.stop()


def test_dashboard_says_which_head_answers_each_class(browser, tmp_path):
    # ASER_HEAD=chosen on the pretrained backbone: each head's windowed accuracy, and the head answering each class;
    # measured on held-back samples, how many are held (each class's 20th) and each head's accuracy on them; the prior
    server = Server(tmp_path / "svc", backbone="lite0", head="chosen", head_measure="held-back", head_prior="mix",
                    batch_size=5, mem_size=20).start()
    try:
        samples = two_classes(20)
        with ServiceClient(server.url) as client:
            client.stream_samples(samples)
            wait_trained(client, len(samples))
        browser.get(server.url + "/")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#head-choice tbody tr"))
        name = browser.find_element(By.ID, "head-name").text
        assert name.startswith("chosen (prior mix) · served ") and " slda " in name and " top " in name
        assert name.endswith(" · held back (2): served –, slda –, top –, mix –, pool –")  # none measured yet
        rows = browser.find_elements(By.CSS_SELECTOR, "#head-choice tbody tr")
        assert sorted(r.get_attribute("data-label") for r in rows) == sorted({label for label, _ in samples})
        assert all(r.find_elements(By.TAG_NAME, "td")[1].text == "slda" for r in rows)  # too young: not the prior
    finally:
        server.stop()


def test_the_suspects_are_reviewed_in_the_page(browser, tmp_path):
    """The suspects card: on request, the memory's most suspected samples with their image, the label sent and the
    model's answer; its buttons relabel, confirm or forget one, through PATCH and DELETE /samples/{seq}."""
    server = Server(tmp_path / "svc", method="er", mem_size=40).start()
    try:
        samples = [("frog" if label == "airplane" and i % 5 == 0 else label, data)  # a few airplanes sent as frogs
                   for i, (label, data) in enumerate(two_classes(40))]
        with ServiceClient(server.url) as client:
            client.stream_samples(samples)
            wait_trained(client, len(samples))
        browser.get(server.url + "/")
        wait(browser, lambda d: counter(d, "samples trained") == "80")
        browser.find_element(By.ID, "find-suspects").click()
        box = browser.find_element(By.ID, "suspects")
        wait(browser, lambda d: box.get_attribute("data-count") == "12")
        listed = httpx.get(server.url + "/suspects", params={"limit": 12}).json()["suspects"]
        figures = box.find_elements(By.TAG_NAME, "figure")
        assert [f.get_attribute("data-seq") for f in figures] == [str(s["seq"]) for s in listed]
        widths = "return [...document.querySelectorAll('#suspects img')].map(i => i.naturalWidth)"
        wait(browser, lambda d: d.execute_script(widths) == [32] * 12)

        acts = {}
        for figure in figures:  # relabel one the model disagrees with, confirm one, forget one
            buttons = {b.get_attribute("data-act"): b for b in figure.find_elements(By.TAG_NAME, "button")}
            act = next((a for a in ("relabel", "confirm", "forget") if a in buttons and a not in acts.values()), None)
            if act:
                buttons[act].click()
                wait(browser, lambda d, f=figure, a=act: f.get_attribute("data-done") == a)
                acts[int(figure.get_attribute("data-seq"))] = act
            if len(acts) == 3:
                break
        assert sorted(acts.values()) == ["confirm", "forget", "relabel"]
        by_seq = {s["seq"]: s for s in listed}
        for seq, act in acts.items():
            info = httpx.get(f"{server.url}/samples/{seq}").json()
            expected = {"relabel": by_seq[seq]["answer"], "confirm": by_seq[seq]["label"], "forget": None}[act]
            assert info["label"] == expected and (info["state"] == "forgotten") == (act == "forget")
    finally:
        server.stop()
