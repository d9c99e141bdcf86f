"""A local CA and a server certificate for Envoy's TLS listener (`make run`, tests).

    files = ensure_local_tls(run_dir / "tls")   # made once, reused while valid
    files.cert, files.key                       # Envoy's certificate chain and key
    files.ca_cert                               # what clients trust

The directory holds ``ca.crt`` / ``ca.key`` (the local CA, 10 years) and
``tls.crt`` / ``tls.key`` (the server certificate for ``localhost``,
127.0.0.1 and ::1, one year, signed by the CA): the names a Kubernetes TLS
Secret uses, so the same directory can be mounted into the Envoy container.
Keys are ECDSA P-256, written with mode 0600 in a directory of mode 0700.

Everything is reused while it is valid: a CA that is not within
``MIN_VALID_DAYS`` of its expiry, with its key; a server certificate signed
by that CA, valid as long, naming every host, with its key. A server
certificate that fails a check is issued again by the same CA (clients that
trust it keep working); a CA that fails one is made again, with a new server
certificate. The ``openssl`` command line does the work.
"""

from __future__ import annotations

import secrets
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CA_DAYS = 3650
SERVER_DAYS = 365
MIN_VALID_DAYS = 30
DNS_NAMES = ("localhost",)
IP_ADDRESSES = ("127.0.0.1", "::1")
CA_SUBJECT = "/O=llm-serving-stack/CN=llm-stack local CA"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The four files of one TLS directory."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def cert(self) -> Path:
        return self.dir / "tls.crt"

    @property
    def key(self) -> Path:
        return self.dir / "tls.key"


def openssl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """One ``openssl`` command; raises RuntimeError with its output when it fails."""
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("no openssl on PATH: it makes make run's TLS certificates")
    result = subprocess.run(
        [binary, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip() or result.stdout}")
    return result


def _valid_for(cert: Path, days: int) -> bool:
    try:
        openssl("x509", "-in", cert, "-noout", "-checkend", str(days * 86400))
    except RuntimeError:
        return False
    return True


def _key_matches(cert: Path, key: Path) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError):
        return False
    return True


def _names_every_host(cert: Path, dns: Sequence[str], ips: Sequence[str]) -> bool:
    # one name per call: openssl x509 keeps only the last -checkhost / -checkip
    checks = [("-checkhost", name) for name in dns] + [("-checkip", ip) for ip in ips]
    for flag, value in checks:
        try:
            out = openssl("x509", "-in", cert, "-noout", flag, value).stdout
        except RuntimeError:
            return False
        if "does match" not in out:
            return False
    return True


def ca_problem(files: TlsFiles, min_days: int = MIN_VALID_DAYS) -> str | None:
    """Why the CA cannot be reused, or None when it can."""
    if not (files.ca_cert.is_file() and files.ca_key.is_file()):
        return "no CA yet"
    if not _valid_for(files.ca_cert, min_days):
        return f"the CA expires within {min_days} days (or is not a certificate)"
    if not _key_matches(files.ca_cert, files.ca_key):
        return "the CA key does not match its certificate"
    return None


def server_problem(
    files: TlsFiles,
    dns: Sequence[str] = DNS_NAMES,
    ips: Sequence[str] = IP_ADDRESSES,
    min_days: int = MIN_VALID_DAYS,
) -> str | None:
    """Why the server certificate cannot be reused (the CA assumed valid), or None."""
    if not (files.cert.is_file() and files.key.is_file()):
        return "no server certificate yet"
    if not _valid_for(files.cert, min_days):
        return f"the server certificate expires within {min_days} days (or is not one)"
    try:
        openssl("verify", "-x509_strict", "-CAfile", files.ca_cert, files.cert)
    except RuntimeError:
        return "the server certificate is not signed by the CA"
    if not _names_every_host(files.cert, dns, ips):
        return "the server certificate does not name " + ", ".join([*dns, *ips])
    if not _key_matches(files.cert, files.key):
        return "the server key does not match its certificate"
    return None


def _install(src: Path, dst: Path) -> None:
    src.chmod(0o600 if src.suffix == ".key" else 0o644)
    src.replace(dst)


def _make_ca(files: TlsFiles, work: Path) -> None:
    key, cert = work / "ca.key", work / "ca.crt"
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", cert, "-days", str(CA_DAYS), "-sha256", "-subj", CA_SUBJECT,
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _install(key, files.ca_key)
    _install(cert, files.ca_cert)


def _make_server(files: TlsFiles, work: Path, dns: Sequence[str], ips: Sequence[str]) -> None:
    key, csr, cert, ext = work / "tls.key", work / "tls.csr", work / "tls.crt", work / "ext.cnf"
    san = ",".join([*(f"DNS:{d}" for d in dns), *(f"IP:{i}" for i in ips)])
    ext.write_text(
        "basicConstraints = critical,CA:FALSE\n"
        "keyUsage = critical,digitalSignature\n"
        "extendedKeyUsage = serverAuth\n"
        f"subjectAltName = {san}\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid\n"
    )
    openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/O=llm-serving-stack/CN={(dns or ips)[0]}",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", csr, "-CA", files.ca_cert, "-CAkey", files.ca_key,
        "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(SERVER_DAYS), "-sha256",
        "-extfile", ext, "-out", cert,
    )  # fmt: skip
    _install(key, files.key)
    _install(cert, files.cert)


def ensure_local_tls(
    directory: str | Path,
    dns: Sequence[str] = DNS_NAMES,
    ips: Sequence[str] = IP_ADDRESSES,
    min_days: int = MIN_VALID_DAYS,
) -> TlsFiles:
    """The CA and server certificate in ``directory``, made or remade only where needed."""
    files = TlsFiles(Path(directory))
    files.dir.mkdir(parents=True, exist_ok=True)
    files.dir.chmod(0o700)
    new_ca = ca_problem(files, min_days) is not None
    if not new_ca and server_problem(files, dns, ips, min_days) is None:
        return files
    with tempfile.TemporaryDirectory(dir=files.dir, prefix=".new-") as tmp:
        work = Path(tmp)
        if new_ca:
            _make_ca(files, work)
        _make_server(files, work, dns, ips)
    return files
