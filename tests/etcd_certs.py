"""Certificates for tests of etcd over TLS, made with the ``openssl`` command (P-256 keys, valid
for a day): a CA, etcd's certificate for 127.0.0.1 (server and peer), a client certificate the
CA signed, and one signed by another CA, which etcd must refuse."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    """A client certificate of another CA."""
    stranger_key: Path

    def client_env(self) -> dict[str, str]:
        """What every ftsystem process reads to reach the TLS etcd with the client's identity."""
        return {"FTSYSTEM_ETCD_CA": str(self.ca), "FTSYSTEM_ETCD_CERT": str(self.client_cert),
                "FTSYSTEM_ETCD_KEY": str(self.client_key)}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)


def _leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "1", "-out", f"{name}.pem",
             "-extfile", f"{name}.ext", cwd=directory)


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _leaf(directory, "etcd", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth,clientAuth\n")  # clientAuth: it is its peers' client
    _leaf(directory, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(directory, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    d = directory
    return Certs(ca=d / "ca.pem", server_cert=d / "etcd.pem", server_key=d / "etcd.key",
                 client_cert=d / "client.pem", client_key=d / "client.key",
                 stranger_cert=d / "stranger.pem", stranger_key=d / "stranger.key")
