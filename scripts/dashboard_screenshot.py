"""Take docs/dashboard.png: the service on its defaults learns a class-incremental
stream of real CIFAR-10 images (three tasks of two classes, 400 images per class) while the
dashboard, in headless Chromium, watches; the memory browser shows one class.

    python scripts/dashboard_screenshot.py --data ../shared/datasets/cifar10-jpeg.zip --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from clients.api import ServiceClient
from clients.bench.live.local_service import LocalService, real_jpegs

TASKS = [["airplane", "automobile"], ["bird", "cat"], ["deer", "dog"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/datasets/cifar10-jpeg.zip")
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--per-class", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalService(Path(tmp) / "data", {"ASER_HISTORY_EVERY_STEPS": "2"}).start()
        options = webdriver.ChromeOptions()
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1700"):
            options.add_argument(arg)
        options.binary_location = shutil.which("chromium")
        browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
        try:
            browser.get(service.url + "/")
            with ServiceClient(service.url) as client:
                sent = 0
                for classes in TASKS:
                    client.stream_samples(real_jpegs(Path(args.data), 2 * args.per_class, classes=classes))
                    sent += 2 * args.per_class
                    while client.status()["samples_trained"] < sent:
                        time.sleep(1)
            Select(browser.find_element(By.ID, "memory-class")).select_by_value("cat")
            time.sleep(6)  # two refreshes: the charts and the memory browser are current
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            browser.save_screenshot(args.out)
            print(f"wrote {args.out}")
        finally:
            browser.quit()
            service.stop()


if __name__ == "__main__":
    main()
