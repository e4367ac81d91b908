"""Throwaway TLS material for tests, made with the openssl command: a CA, a server certificate for
localhost/127.0.0.1 and a client certificate, both signed by that CA (EC P-256, valid one day)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: the CA's certificate, the server's and the client's certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _signed(folder: Path, name: str, extensions: str) -> tuple[Path, Path]:
    """name.crt / name.key in folder, signed by folder's ca.crt / ca.key."""
    key, csr, crt, ext = (folder / f"{name}.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    ext.write_text(extensions)
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
             "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", csr, "-CA", folder / "ca.crt", "-CAkey", folder / "ca.key", "-CAcreateserial",
             "-days", "1", "-out", crt, "-extfile", ext)  # fmt: skip
    return crt, key


def make_tls_files(folder: Path) -> TlsFiles:
    """Skips the test where there is no openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
             "-keyout", folder / "ca.key", "-out", folder / "ca.crt", "-subj", "/CN=pdserve test CA")  # fmt: skip
    server = _signed(folder, "server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    client = _signed(folder, "client", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    return TlsFiles(folder / "ca.crt", *server, *client)
