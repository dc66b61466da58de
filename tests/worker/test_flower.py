"""Flower as operators use it, in headless Chromium: ``specbatch flower`` against a real worker
running jobs shows a known job's custom_id on the Tasks page, its worker on the Workers page and
its queue on the Broker page; with basic auth on, an unauthenticated request gets 401; bound
beyond loopback without auth, it refuses to start."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.browser import artifacts_dir
from tests.worker.test_integration import start_worker, wait_until
from tests.worker.test_metrics import free_port
from worker.common.config import Settings

pytestmark = pytest.mark.integration


def start_flower(redis_url: str, queue: str, port: int, tmp_path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, REDIS_URL=redis_url, SPECBATCH_BROKER_URL=redis_url)
    log = open(tmp_path / f"flower-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker.api.cli", "flower", "--port", str(port), "--queue", queue,
                             *args], env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2)
            return proc
        except urllib.error.HTTPError:  # up, behind auth
            return proc
        except OSError:
            assert proc.poll() is None, (tmp_path / f"flower-{port}.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "flower did not come up"
            time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def page_shows(driver, url: str, text: str, timeout: float = 60.0) -> None:
    """Load ``url`` until ``text`` is in the rendered page's DOM (Flower fills its tables by XHR;
    a narrow column may wrap a name, so the DOM, not the visible text, is searched)."""
    deadline = time.monotonic() + timeout
    while True:
        driver.get(url)
        try:
            WebDriverWait(driver, 5).until(lambda d: text in d.page_source)
            return
        except Exception:
            assert time.monotonic() < deadline, f"{text!r} never appeared on {url}"


def test_flower_shows_jobs_workers_and_queues(browser, sqlite_url, redis_url, unique_queue, tiny_model_dir,
                                              tmp_path):
    from worker.api.client import Client

    port = free_port()
    flower = start_flower(redis_url, unique_queue, port, tmp_path)
    client = Client(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir, queue=unique_queue)
    settings = Settings(broker_url=redis_url, database_url=sqlite_url, model=tiny_model_dir, device="cpu",
                        queue=unique_queue)
    worker = start_worker(client, settings, tmp_path, seqs=4)
    try:
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        lines = [{"custom_id": probe if i == 3 else f"line-{i}", "prompt": f"tell me about {i}", "max_tokens": 8}
                 for i in range(6)]
        batch = client.submit_batch(lines, name=unique_queue)
        wait_until(lambda: client.store.refresh_batch(batch.batch_id)["succeeded"] == 6, timeout=120)
        job = next(j for j in client.store.jobs(batch.batch_id) if j.custom_id == probe)
        shots = artifacts_dir()
        base = f"http://127.0.0.1:{port}"

        page_shows(browser, f"{base}/tasks", probe)
        body = browser.find_element(By.TAG_NAME, "body").text
        text = browser.execute_script("return document.body.textContent")
        assert f"custom_id={probe!r} line={job.line_no} batch={batch.batch_id!r} job={job.id!r}" in text  # its args
        assert "tell me about" not in body  # never the prompt
        browser.save_screenshot(str(shots / "flower-tasks.png"))

        # The batch's six short jobs travelled in one message (worker.dispatch.publish.job_groups): its
        # page, reached from the probe's row, shows what became of them.
        row = browser.find_element(By.XPATH, f"//tr[contains(., '{probe}')]")
        page_shows(browser, row.find_element(By.TAG_NAME, "a").get_attribute("href"), "'succeeded': 6")
        body = browser.find_element(By.TAG_NAME, "body").text
        assert "'jobs': 6" in body and f"'tokens': {job.num_output_tokens}" in body

        page_shows(browser, f"{base}/workers", worker.node)
        browser.save_screenshot(str(shots / "flower-workers.png"))

        page_shows(browser, f"{base}/broker", unique_queue)
        assert f"{unique_queue}.interactive" in browser.find_element(By.TAG_NAME, "body").text
        browser.save_screenshot(str(shots / "flower-broker.png"))
    finally:
        worker.stop(timeout=30)
        stop(flower)


def test_flower_with_basic_auth_answers_401_without_credentials(redis_url, unique_queue, tmp_path):
    port = free_port()
    flower = start_flower(redis_url, unique_queue, port, tmp_path, "--basic-auth", "ops:s3cret")
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/tasks", timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(f"http://127.0.0.1:{port}/tasks", headers={
            "Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()})
        assert urllib.request.urlopen(request, timeout=10).status == 200
    finally:
        stop(flower)


def test_flower_refuses_a_public_address_without_auth(redis_url):
    env = dict(os.environ, REDIS_URL=redis_url)
    env.pop("FLOWER_BASIC_AUTH", None)
    done = subprocess.run([sys.executable, "-m", "worker.api.cli", "flower", "--address", "0.0.0.0"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "without authentication" in done.stderr


def test_flower_without_a_broker_says_how_to_point_it_at_the_workers():
    """Without a broker URL it once watched a private embedded Redis where no worker can appear."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPECBATCH_BROKER_URL")}
    done = subprocess.run([sys.executable, "-m", "worker.api.cli", "flower"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "no broker configured" in message and "REDIS_URL=redis://HOST:6379/0 specbatch flower" in message
