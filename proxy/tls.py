"""TLS to replicas: one ``ssl.SSLContext`` per replica from its own files.

A replica behind a private CA is verified with ``replicas[].ca_file`` (that
bundle replaces the system trust store for that replica only); one that wants
mutual TLS gets the client certificate ``cert_file`` with its ``key_file``.
The context built here is the only one used for that replica: requests, health
probes, warm-up and metrics scrapes all pass it, so a probe never trusts what a
request would refuse.

Files are read at config validation (so ``config check``, start-up and a
reload all refuse a missing or unreadable file at its YAML path) and again
when the context is built. A reload keeps a replica's context while its files'
paths and contents are unchanged, so pooled connections survive, and builds a
new one when they change. File reads here are blocking: call from a thread
(reload) or before the loop serves (start-up).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.config_errors import ConfigError, ConfigIssue

#: The replica keys this module reads, in the order they are checked.
TLS_KEYS = ("ca_file", "cert_file", "key_file")


class TlsFiles(Protocol):
    """The replica config's TLS keys (``ReplicaConfig`` has them)."""

    @property
    def ca_file(self) -> str | None: ...
    @property
    def cert_file(self) -> str | None: ...
    @property
    def key_file(self) -> str | None: ...


class NamedTlsFiles(TlsFiles, Protocol):
    @property
    def name(self) -> str: ...


class TlsFileError(ValueError):
    """A TLS file that cannot be used; ``key`` is the replica key it came from."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class ReplicaTls:
    """A replica's TLS context and what it was built from (to notice a change)."""

    files: tuple[str | None, str | None, str | None]
    digest: str
    context: ssl.SSLContext


def _no_password() -> bytes:
    """An encrypted key fails to load instead of OpenSSL prompting on the terminal."""
    return b""


def load_context(files: TlsFiles) -> ssl.SSLContext | None:
    """The verifying client context the files describe; None when none is set.

    Raises ``TlsFileError`` naming the key whose file is missing or unusable.
    """
    if files.ca_file is None and files.cert_file is None and files.key_file is None:
        return None
    if (files.cert_file is None) != (files.key_file is None):
        missing = "key_file" if files.key_file is None else "cert_file"
        given = "cert_file" if missing == "key_file" else "key_file"
        raise TlsFileError(missing, f"required with {given} (a client certificate needs both)")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(
            "ca_file", f"cannot load CA bundle {files.ca_file!r}: {_reason(exc)}"
        ) from None
    if files.cert_file is not None:
        try:
            context.load_cert_chain(files.cert_file, files.key_file, password=_no_password)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFileError(
                "cert_file",
                f"cannot load client certificate {files.cert_file!r} with key "
                f"{files.key_file!r}: {_reason(exc)} (an encrypted key is not supported)",
            ) from None
    return context


def build_tls(files: TlsFiles) -> ReplicaTls | None:
    """The context with the fingerprint of its files (for reload), or None."""
    context = load_context(files)
    if context is None:
        return None
    paths = (files.ca_file, files.cert_file, files.key_file)
    try:
        digest = _digest(p for p in paths if p is not None)
    except OSError as exc:  # removed or replaced since the context was loaded
        raise TlsFileError("ca_file", f"cannot read {exc.filename!r}: {_reason(exc)}") from None
    return ReplicaTls(paths, digest, context)


def tls_by_replica(replicas: Sequence[NamedTlsFiles]) -> dict[str, ReplicaTls | None]:
    """Every replica's context (start-up, reload), or ``ConfigError`` at the YAML paths.

    Validation loaded the same files moments before; this fails only when one
    changed or vanished in between.
    """
    built: dict[str, ReplicaTls | None] = {}
    issues: list[ConfigIssue] = []
    for i, replica in enumerate(replicas):
        try:
            built[replica.name] = build_tls(replica)
        except TlsFileError as exc:
            issues.append(ConfigIssue(f"replicas[{i}].{exc.key}", str(exc)))
    if issues:
        raise ConfigError(issues)
    return built


def same_files(tls: ReplicaTls | None, new: ReplicaTls | None) -> bool:
    """Both absent, or built from the same paths with the same contents."""
    if tls is None or new is None:
        return tls is new
    return (tls.files, tls.digest) == (new.files, new.digest)


def _digest(paths: Iterable[str]) -> str:
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as file:
            sha.update(hashlib.sha256(file.read()).digest())
    return sha.hexdigest()


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return exc.strerror or str(exc)
