"""URLs: passwords masked wherever one is shown; ``rediss://`` verifies the server by default."""

from __future__ import annotations

import ssl

from worker.dispatch.app import broker_ssl
from worker.common.config import redact_url


def test_redact_url_masks_passwords_and_keeps_the_rest():
    cases = {
        "redis://:s3cret@127.0.0.1:6379/0": "redis://:***@127.0.0.1:6379/0",
        "rediss://user:p%40ss@h:6380/1?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem":
            "rediss://user:***@h:6380/1?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem",
        "postgresql+psycopg://postgres:hunter2@db:5432/test": "postgresql+psycopg://postgres:***@db:5432/test",
        "redis://h:6379/0?password=abc&db=2": "redis://h:6379/0?password=***&db=2",
        "redis+socket:///tmp/redis.sock": "redis+socket:///tmp/redis.sock",
        "sqlite:///specbatch.db": "sqlite:///specbatch.db",
        "redis://user@h/0": "redis://user@h/0",
        "redis://:a:b@c@h/0": "redis://:***@h/0",
    }
    for url, shown in cases.items():
        assert redact_url(url) == shown
    assert redact_url(None) is None


def test_rediss_without_options_verifies_the_server():
    assert broker_ssl("redis://h/0") is None and broker_ssl("redis+socket:///x") is None
    assert broker_ssl("rediss://h/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert broker_ssl("rediss://h/0?ssl_ca_certs=/ca.pem") == {"ssl_ca_certs": "/ca.pem",
                                                                "ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert broker_ssl("rediss://h/0?ssl_cert_reqs=none") is None  # an explicit choice is kombu's to read
