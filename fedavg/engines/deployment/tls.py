"""TLS certificates and node keys: which files, and checks that they are usable.

``fedavg certs DIR`` writes the files named here (:mod:`fedavg.engines.deployment.certs`); the
coordinator
needs all three TLS files, a node only the CA certificate. Node authentication uses
Flower's SuperNode keys (OpenSSH EC keys on a NIST curve).
"""

from __future__ import annotations

from pathlib import Path

from fedavg.util.errors import UserError

#: Files written by ``fedavg certs``.
CA_CERT, SERVER_CERT, SERVER_KEY = "ca.crt", "coordinator.crt", "coordinator.key"
AUTH_KEYS = "authorized-nodes.pub"


def resolve_certs(certs: Path | None, insecure: bool, role: str) -> Path | None:
    """Return the certificate folder to use, or ``None`` with ``insecure``.

    Parameters
    ----------
    certs : path, optional
        ``--certs``.
    insecure : bool
        ``--insecure``.
    role : str
        ``coordinator`` (needs certificate and key too) or ``node``.

    Raises
    ------
    UserError
        Neither given, both given, files missing, or a CA certificate that is not one.
    """
    if insecure:
        if certs is not None:
            raise UserError("give either --certs or --insecure, not both")
        return None
    if certs is None:
        raise UserError(f"TLS is on by default: pass --certs DIR (make one with `fedavg certs "
                        f"DIR`), or --insecure to run the {role} without TLS")
    if not certs.exists():
        raise UserError(f"--certs {certs}: no such folder; make one with `fedavg certs "
                        f"{certs}`")
    if certs.is_file():
        raise UserError(f"--certs takes a folder (made by `fedavg certs DIR`), not the file "
                        f"{certs}: pass --certs {certs.parent}")
    need = [CA_CERT] + ([SERVER_CERT, SERVER_KEY] if role == "coordinator" else [])
    missing = [n for n in need if not (certs / n).is_file()]
    if missing:
        raise UserError(f"--certs {certs} lacks {', '.join(missing)}; make them with "
                        f"`fedavg certs {certs}`")
    from cryptography import x509

    try:  # a SuperNode given anything else hangs, silent, in its own TLS set-up
        x509.load_pem_x509_certificates((certs / CA_CERT).read_bytes())
    except ValueError:
        raise UserError(f"{certs / CA_CERT} is not a PEM certificate: copy the ca.crt that "
                        "`fedavg certs` wrote") from None
    return certs


def check_server_certs(certs: Path) -> None:
    """Check that the coordinator's certificate and key load and belong together.

    Raises
    ------
    UserError
        A file is not PEM, or the key does not match the certificate.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate((certs / SERVER_CERT).read_bytes())
    except ValueError:
        raise UserError(f"{certs / SERVER_CERT} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key((certs / SERVER_KEY).read_bytes(), None)
    except (ValueError, TypeError):
        raise UserError(f"{certs / SERVER_KEY} is not an unencrypted PEM private key") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if key.public_key().public_bytes(*fmt) != cert.public_key().public_bytes(*fmt):
        raise UserError(f"{certs / SERVER_KEY} is not the key of {certs / SERVER_CERT}")


def check_node_key(path: Path) -> None:
    """Check that ``path`` is a node private key (OpenSSH, EC on a NIST curve).

    Raises
    ------
    UserError
        Missing, or not such a key (e.g. a public key).
    """
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    if not path.is_file():
        raise UserError(f"--auth-key {path} does not exist")
    try:
        key = load_ssh_private_key(path.read_bytes(), None)
    except Exception:  # noqa: BLE001 - any parse failure means: not a usable key
        key = None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UserError(f"--auth-key {path} is not a node private key (node-<i>.key from "
                        "`fedavg certs DIR --nodes N`)")


def load_auth_keys(path: Path) -> list[bytes]:
    """Public keys (OpenSSH ``ecdsa-sha2-nistp384 ...`` lines) of the nodes allowed in.

    Parameters
    ----------
    path : path
        A file with one key per line, or a folder of ``*.pub`` files.

    Returns
    -------
    list of bytes
        Each distinct key, PEM (SubjectPublicKeyInfo), in file order.

    Raises
    ------
    UserError
        Missing path, no key, or a line that is not a NIST-curve EC public key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not path.exists():
        raise UserError(f"--auth-keys {path} does not exist")
    files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
    keys: list[bytes] = []
    for f in files:
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                key = serialization.load_ssh_public_key(line.strip().encode())
            except Exception as exc:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm ...
                raise UserError(f"{f}:{n} is not an OpenSSH public key "
                                f"({str(exc).splitlines()[0][:80] if str(exc) else exc!r})"
                                ) from None
            if not isinstance(key, ec.EllipticCurvePublicKey):
                raise UserError(f"{f}:{n} is not an EC public key (make keys with "
                                "`fedavg certs DIR --nodes N`)")
            pem = key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)
            if pem not in keys:
                keys.append(pem)
    if not keys:
        raise UserError(f"--auth-keys {path} holds no public key")
    return keys


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool | None:
    """Whether the server at ``host:port`` answers a TLS handshake.

    Only the handshake is tried (no certificate check, nothing sent after it), to tell a
    node run with the wrong ``--insecure`` / ``--certs`` choice what to change.

    Returns
    -------
    bool or None
        ``True``: it speaks TLS; ``False``: it answers, but not TLS; ``None``: unreachable.
    """
    import socket
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            try:
                with context.wrap_socket(sock, server_hostname=host):
                    return True
            except (ssl.SSLError, ConnectionResetError, socket.timeout):
                return False
    except OSError:
        return None


def tls_mismatch(host: str, port: int, insecure: bool) -> str | None:
    """Say what to change when the node's TLS choice differs from the coordinator's."""
    tls = speaks_tls(host, port)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    other = "; if no fedavg coordinator listens there, fix --coordinator"
    if insecure and tls is True:
        return (f"the coordinator at {address} uses TLS: pass --certs DIR (holding its "
                f"ca.crt) instead of --insecure{other}")
    if not insecure and tls is False:
        return (f"the coordinator at {address} does not use TLS: pass --insecure on the "
                f"node, or start the coordinator with --certs{other}")
    return None


def certificate_problem(host: str, port: int, ca_file: Path,
                        timeout_s: float = 3.0) -> str | None:
    """Say which part of the coordinator's TLS certificate a node at ``host`` cannot use.

    The node's TLS handshake failed; this one tells an unknown signer (another ``ca.crt``)
    from a certificate that does not name ``host`` (the address the node dials), and lists
    the names it does hold.

    Returns
    -------
    str or None
        What to change; ``None`` when the certificate verifies and names ``host``, or the
        coordinator cannot be reached.
    """
    import ipaddress
    import socket
    import ssl

    from cryptography import x509

    context = ssl.create_default_context(cafile=str(ca_file))
    context.check_hostname = False  # the chain is still verified; the name is checked below
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock, \
                context.wrap_socket(sock, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError:
        return (f"the coordinator's TLS certificate is not signed by {ca_file}: use the "
                "ca.crt of the coordinator's `fedavg certs` folder")
    except (OSError, ValueError):
        return None
    try:
        sans = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    names = [str(n) for n in sans.get_values_for_type(x509.DNSName)]
    ips = sans.get_values_for_type(x509.IPAddress)
    try:
        if ipaddress.ip_address(host) in ips:
            return None
    except ValueError:  # a host name
        if host.lower() in (n.lower() for n in names):
            return None
    held = ", ".join(names + [str(ip) for ip in ips]) or "no address"
    return (f"the coordinator's TLS certificate names {held}, not {host}: dial one of those, "
            f"or remake its certificates with `fedavg certs DIR --host {host}` (the nodes "
            "then need the new ca.crt)")
