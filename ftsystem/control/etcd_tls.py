"""TLS between ftsystem and etcd: the client's certificates and the embedded server's.

Every process that talks to etcd (``ftsystem run``, the controller, the agent, the training
ranks, ``ftsystem job``, ``ftsystem chaos apply``) reads the same three variables, and its
children inherit them: setting them once, or passing ``--etcd-ca``/``--etcd-cert``/
``--etcd-key`` to a command (which sets them for its children), configures the whole job.
Files are read once, when a client is made, so a missing or unreadable one is named at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

import grpc

ENV_CA = "FTSYSTEM_ETCD_CA"
"""PEM file of the CA that signed etcd's server certificate (unset: the system's roots)."""
ENV_CERT = "FTSYSTEM_ETCD_CERT"
"""PEM file of this client's certificate, for an etcd started with ``--client-cert-auth``."""
ENV_KEY = "FTSYSTEM_ETCD_KEY"
"""PEM file of the private key of ``FTSYSTEM_ETCD_CERT``."""
ENV_NAMES = (ENV_CA, ENV_CERT, ENV_KEY)
WHAT_TO_SET = (f"use https:// endpoints and set {ENV_CA} (the CA of etcd's certificate), "
               f"{ENV_CERT} and {ENV_KEY} (a client certificate that CA signed), or pass "
               "--etcd-ca, --etcd-cert and --etcd-key")


class EtcdTlsError(ValueError):
    """A certificate setting that cannot work: the message names the setting and the fix."""


def read_pem(setting: str, path: str | Path) -> bytes:
    """The PEM text of ``path``, or :class:`EtcdTlsError` naming ``setting`` and why not."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise EtcdTlsError(f"{setting}={path}: cannot read it ({e.strerror or e}); point "
                           f"{setting} at a readable PEM file") from e
    if b"-----BEGIN " not in data:
        raise EtcdTlsError(f"{setting}={path}: not a PEM file (no -----BEGIN line); give the "
                           "certificate or key in PEM form")
    return data


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What an etcd client presents and trusts: PEM bytes, read from the files."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca: str | Path | None, cert: str | Path | None,
                   key: str | Path | None, *, names: tuple[str, str, str] = ENV_NAMES
                   ) -> "ClientTls | None":
        """Read the given files (None: not set); None when none is. ``names``: how errors
        call the three settings."""
        if (cert is None) != (key is None):
            given, missing = (names[1], names[2]) if key is None else (names[2], names[1])
            raise EtcdTlsError(f"{given} is set but {missing} is not: a client certificate "
                               "needs its private key, and a key its certificate")
        if ca is None and cert is None:
            return None
        return cls(*(None if path is None else read_pem(name, path)
                     for name, path in zip(names, (ca, cert, key))))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClientTls | None":
        """The settings of ``FTSYSTEM_ETCD_CA``/``_CERT``/``_KEY``; None when none is set."""
        env = os.environ if env is None else env
        return cls.from_files(*(env.get(name) or None for name in ENV_NAMES))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def export_client_files(ca: Path | None, cert: Path | None, key: Path | None,
                        env: MutableMapping[str, str] = os.environ) -> None:
    """Check the files of ``--etcd-ca``/``--etcd-cert``/``--etcd-key`` and put them in ``env``
    (absolute: a child may run elsewhere), where this process's clients and its children find
    them. Settings not given keep what ``env`` has."""
    given = {name: path for name, path in zip(ENV_NAMES, (ca, cert, key)) if path is not None}
    merged = {name: env.get(name) or None for name in ENV_NAMES} | given
    ClientTls.from_files(*(merged[name] for name in ENV_NAMES))
    for name, path in given.items():
        env[name] = str(Path(path).resolve())


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTls:
    """An etcd's own certificate, and the CA whose client certificates it accepts (no other
    client is served). The same certificate serves its peers, so it must be valid for both
    server and client authentication when the cluster has several members."""

    cert: Path
    key: Path
    client_ca: Path

    def __post_init__(self) -> None:
        for setting, path in (("--cert", self.cert), ("--key", self.key),
                              ("--client-ca", self.client_ca)):
            read_pem(setting, path)

    def flags(self) -> list[str]:
        files = [str(Path(p).resolve()) for p in (self.cert, self.key, self.client_ca)]
        return ["--cert-file", files[0], "--key-file", files[1], "--trusted-ca-file", files[2],
                "--client-cert-auth",
                "--peer-cert-file", files[0], "--peer-key-file", files[1],
                "--peer-trusted-ca-file", files[2], "--peer-client-cert-auth"]
