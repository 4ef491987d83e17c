"""``fedavg certs DIR``: a CA, the coordinator's TLS certificate and node key pairs.

For a quick start on a private network. Files (PEM unless noted):

- ``ca.crt`` / ``ca.key``: the certificate authority. Copy ``ca.crt`` to every node; keep
  ``ca.key`` private (it can sign more certificates).
- ``coordinator.crt`` / ``coordinator.key``: the SuperLink's TLS certificate, valid for
  ``localhost``, ``127.0.0.1``, ``::1``, this machine's host name and every ``--host``.
- ``node-<i>.key`` / ``node-<i>.pub`` (OpenSSH): node key pairs (OpenSSH format) for
  Flower's SuperNode authentication (ECDSA P-384). Flower authenticates nodes by key, not by client
  certificate. ``authorized-nodes.pub`` lists all public keys: the coordinator's
  ``--auth-keys``.

Private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import socket
from pathlib import Path

from fedavg.util.errors import UserError

CA_DAYS = 3650
CERT_DAYS = 825
#: The most node key pairs one ``fedavg certs`` call makes (each takes a few ms).
MAX_NODES = 10_000


def _write(path: Path, data: bytes, private: bool = False) -> None:
    try:
        _write_file(path, data, private)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def _write_file(path: Path, data: bytes, private: bool) -> None:
    if private:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        path.chmod(0o600)
    else:
        path.write_bytes(data)


def _san(hosts: list[str]):
    from cryptography import x509

    names: list = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_certs(folder: Path, hosts: list[str] | None = None, nodes: int = 0,
               overwrite: bool = False) -> list[Path]:
    """Write a CA, a coordinator certificate and ``nodes`` node key pairs into ``folder``.

    Parameters
    ----------
    folder : pathlib.Path
        Created if missing.
    hosts : list of str, optional
        Extra host names or IP addresses nodes use to reach the coordinator.
    nodes : int
        Node key pairs to make (0 for none).
    overwrite : bool
        Replace existing files (node key pairs beyond the new ``nodes`` go too, as
        ``authorized-nodes.pub`` no longer lists them); otherwise an existing ``ca.key`` is
        refused.

    Returns
    -------
    list of pathlib.Path
        The files written.

    Raises
    ------
    UserError
        ``folder`` already holds a CA (without ``overwrite``), a host name is empty, or
        ``nodes`` is negative or above :data:`MAX_NODES`.
    """
    from cryptography.hazmat.primitives import serialization

    if not 0 <= nodes <= MAX_NODES:
        raise UserError(f"--nodes must be in 0..{MAX_NODES}, got {nodes}")
    hosts = list(hosts or [])
    _check_hosts(hosts)
    _prepare_folder(folder, overwrite)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    pem = serialization.Encoding.PEM
    no_pw = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8

    ca_key, ca = _make_ca(now)
    key, cert = _make_coordinator_cert(ca_key, ca.subject, hosts, now)
    written = []
    for name, data, private in (
        ("ca.key", ca_key.private_bytes(pem, pkcs8, no_pw), True),
        ("ca.crt", ca.public_bytes(pem), False),
        ("coordinator.key", key.private_bytes(pem, pkcs8, no_pw), True),
        ("coordinator.crt", cert.public_bytes(pem), False),
    ):
        _write(folder / name, data, private)
        written.append(folder / name)
    written += _write_node_keys(folder, nodes)
    for stale in sorted(folder.glob("node-*")) + [folder / "authorized-nodes.pub"]:
        if overwrite and stale not in written and stale.is_file() and (
                stale.name == "authorized-nodes.pub"
                or re.fullmatch(r"node-\d+\.(key|pub)", stale.name)):
            stale.unlink()  # an earlier call's node keys: the new ones replace them all
    return written


def _check_hosts(hosts: list[str]) -> None:
    """Refuse a ``--host`` that is neither an IP address nor a host name."""
    for h in hosts:
        problem = host_problem(h, wildcard=True)
        if problem:
            raise UserError(f"--host {h!r} {problem}")


def host_problem(host: str, wildcard: bool = False) -> str | None:
    """Say why ``host`` is neither an IP address nor a host name, or return ``None``.

    ``wildcard``: a certificate's name: a ``*`` label (``*.example.org``) is allowed, and
    ``_`` is not. Otherwise (an address to connect to) ``_`` is, as in container names.
    """
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    start, inner = ("[A-Za-z0-9]", "A-Za-z0-9-") if wildcard else ("[A-Za-z0-9_]", r"\w-")
    first = "[A-Za-z0-9*]" if wildcard else start
    if not re.fullmatch(rf"(?=.{{1,253}}$){first}([{inner}]*[A-Za-z0-9])?"
                        rf"(\.{start}([{inner}]*[A-Za-z0-9])?)*", host, re.ASCII):
        return "is not a host name or an IP address (no scheme, port or spaces)"
    if host.rsplit(".", 1)[-1].isdigit():  # a name's last label is never a number
        return "is not a valid IP address"
    return None


def _prepare_folder(folder: Path, overwrite: bool) -> None:
    """Create ``folder``; refuse a file, or a folder holding a CA unless ``overwrite``."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; give a folder")
    if (folder / "ca.key").exists() and not overwrite:
        raise UserError(f"{folder} already holds a CA; pass --overwrite to replace it "
                        "(nodes then need the new ca.crt)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {folder}: {exc.strerror}") from None


def _make_ca(now: dt.datetime):
    """Make a self-signed ECDSA P-384 CA valid ``CA_DAYS`` from ``now``: ``(key, cert)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedavg CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + dt.timedelta(days=CA_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA384()))
    return ca_key, ca


def _make_coordinator_cert(ca_key, ca_name, hosts: list[str], now: dt.datetime):
    """Make the SuperLink's server certificate, signed by the CA: ``(key, cert)``.

    Valid ``CERT_DAYS`` from ``now`` for ``localhost``, ``127.0.0.1``, ``::1``, this
    machine's host name and ``hosts``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP384R1())
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), *hosts]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        "fedavg coordinator")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=CERT_DAYS))
            .add_extension(_san(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


def _write_node_keys(folder: Path, nodes: int) -> list[Path]:
    """Write ``nodes`` OpenSSH node key pairs and ``authorized-nodes.pub``; return the files."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    no_pw = serialization.NoEncryption()
    written, pubs = [], []
    for i in range(nodes):
        nkey = ec.generate_private_key(ec.SECP384R1())
        pub = nkey.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                             serialization.PublicFormat.OpenSSH)
        pubs.append(pub + f" node-{i}".encode())
        _write(folder / f"node-{i}.key",
               nkey.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.OpenSSH, no_pw), True)
        _write(folder / f"node-{i}.pub", pubs[-1] + b"\n")
        written += [folder / f"node-{i}.key", folder / f"node-{i}.pub"]
    if nodes:
        _write(folder / "authorized-nodes.pub", b"\n".join(pubs) + b"\n")
        written.append(folder / "authorized-nodes.pub")
    return written


def unignored_git_work_tree(folder: Path) -> Path | None:
    """Return the git work tree holding ``folder`` when git does not ignore the folder.

    Private keys written there could be committed. ``None`` outside a work tree or when git
    ignores the folder (without a git command to ask, the folder counts as not ignored).
    """
    import subprocess

    resolved = folder.resolve()
    repo = next((p for p in (resolved, *resolved.parents) if (p / ".git").exists()), None)
    if repo is None:
        return None
    try:
        ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(resolved)],
                                 capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ignored = False
    return None if ignored else repo
