"""What the container image runs besides ``fedavg``: its health check, replica indices, set-up.

``python -m fedavg.engines.deployment.containers COMMAND`` uses the standard library only
(and ``cryptography`` for ``init``), so a health check costs a Python start-up, not a torch
import.

``health``
    The image's HEALTHCHECK. A container running ``fedavg coordinator`` is healthy once the
    coordinator's port accepts connections (its ``--address``, default ``127.0.0.1:9092``).
    Any other container (a node, ``simulate``, a one-shot command) is healthy while it runs,
    so a node is never marked unhealthy.
``run ARG...``
    Exec ``ARG...`` with ``{index}`` replaced by this replica's index (0-based), then the shell
    words of ``$EXTRA_ARGS`` appended. Compose names the replicas of a service
    ``<project>-<service>-<n>`` (n from 1) but tells a container nothing of it; the index comes
    from the container's own name, which Docker's embedded DNS returns for the container's
    address (a PTR query), or from ``$NODE_INDEX`` when set. With ``$GPU_PER_NODE`` set,
    ``CUDA_VISIBLE_DEVICES`` becomes ``index mod GPUs``: one GPU per replica.
``init``
    Once per stack, as root: make the certificates and node keys unless the folder already
    holds fitting ones, and hand them, and an output folder Docker has just created, to the
    user the other services run as.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import shlex
import socket
import struct
import sys
import time
from pathlib import Path

from fedavg.util.errors import UserError

DEFAULT_ADDRESS = "127.0.0.1:9092"
INDEX = "{index}"
PTR = 12


# ---- health -------------------------------------------------------------------------------

def coordinator_address(argv: list[str]) -> str | None:
    """Return the address a ``fedavg coordinator`` command line listens on (None: another command).

    Parameters
    ----------
    argv : list of str
        A process's arguments, e.g. ``["/opt/venv/bin/python", "/opt/venv/bin/fedavg",
        "coordinator", "--address", "0.0.0.0:9092"]``.

    Returns
    -------
    str or None
        ``host:port`` from ``--address`` (``127.0.0.1:9092`` when absent); None when ``argv``
        is not ``fedavg coordinator``.
    """
    for i, arg in enumerate(argv[:-1]):
        if (Path(arg).name == "fedavg" or arg == "fedavg.cli") and argv[i + 1] == "coordinator":
            address = DEFAULT_ADDRESS
            rest = argv[i + 2:]
            for j, opt in enumerate(rest):
                if opt == "--address" and j + 1 < len(rest):
                    address = rest[j + 1]
                elif opt.startswith("--address="):
                    address = opt.split("=", 1)[1]
            return address
    return None


def running_coordinator(proc: Path = Path("/proc")) -> str | None:
    """Return the address of a ``fedavg coordinator`` running in this container, if any."""
    pids = sorted((p for p in proc.glob("[0-9]*") if p.name.isdigit()), key=lambda p: int(p.name))
    for pid in pids:
        try:
            raw = (pid / "cmdline").read_bytes()
        except OSError:
            continue
        address = coordinator_address([a.decode(errors="replace") for a in raw.split(b"\0") if a])
        if address is not None:
            return address
    return None


def probe(address: str, timeout_s: float = 3.0) -> None:
    """Open and close a TCP connection to ``address`` (``host:port``; ``0.0.0.0`` = loopback).

    Raises
    ------
    OSError
        Nothing accepts connections there within ``timeout_s`` seconds.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass


def health(proc: Path = Path("/proc")) -> int:
    """Exit status of the health check: 0 healthy, 1 a coordinator whose port is closed."""
    address = running_coordinator(proc)
    if address is None:
        print("healthy: no coordinator in this container, so running is enough")
        return 0
    try:
        probe(address)
    except (OSError, ValueError) as exc:
        print(f"unhealthy: the coordinator's {address} does not accept connections ({exc})")
        return 1
    print(f"healthy: the coordinator accepts connections on {address}")
    return 0


# ---- replica index ------------------------------------------------------------------------

def _encode_name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode("ascii") for p in name.split(".") if p) + b"\0"


def _read_name(msg: bytes, pos: int) -> tuple[str, int]:
    """Decode the (possibly compressed) DNS name at ``pos``: ``(name, position after it)``."""
    labels: list[str] = []
    end = None
    for _ in range(128):
        length = msg[pos]
        if length & 0xC0 == 0xC0:  # a pointer to a name earlier in the message
            end = pos + 2 if end is None else end
            pos = ((length & 0x3F) << 8) | msg[pos + 1]
            continue
        pos += 1
        if length == 0:
            return ".".join(labels), pos if end is None else end
        labels.append(msg[pos:pos + length].decode("ascii", "replace"))
        pos += length
    raise ValueError("DNS name loops")


def ptr_query(ip: str, query_id: int) -> bytes:
    """Build a DNS query (RFC 1035) for the PTR records of ``ip``, with the 16-bit ``query_id``."""
    qname = ipaddress.ip_address(ip).reverse_pointer
    return (struct.pack("!6H", query_id, 0x0100, 1, 0, 0, 0) + _encode_name(qname)
            + struct.pack("!2H", PTR, 1))


def parse_ptr_reply(reply: bytes, query_id: int) -> list[str]:
    """Return the PTR names in a DNS reply to ``query_id``; empty for an error or no answer.

    Raises
    ------
    ValueError
        The reply is truncated or malformed.
    """
    try:
        rid, flags, questions, answers, _, _ = struct.unpack_from("!6H", reply)
        if rid != query_id or flags & 0x000F:
            return []
        pos = 12
        for _ in range(questions):
            pos = _read_name(reply, pos)[1] + 4
        names = []
        for _ in range(answers):
            pos = _read_name(reply, pos)[1]
            rtype, _, _, length = struct.unpack_from("!HHIH", reply, pos)
            pos += 10
            if rtype == PTR:
                names.append(_read_name(reply, pos)[0])
            pos += length
        return names
    except (IndexError, struct.error) as exc:
        raise ValueError(f"malformed DNS reply: {exc}") from None


def reverse_lookup(ip: str, server: tuple[str, int], timeout_s: float = 2.0) -> list[str]:
    """Ask the DNS server ``(host, port)`` for the names of ``ip`` (not /etc/hosts).

    Raises
    ------
    OSError
        No reply within ``timeout_s`` seconds.
    ValueError
        A malformed reply.
    """
    query_id = secrets.randbits(16)
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        sock.sendto(ptr_query(ip, query_id), server)
        return parse_ptr_reply(sock.recv(4096), query_id)


def _nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> str:
    for line in resolv_conf.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            return parts[1]
    raise UserError(f"no nameserver in {resolv_conf}; set NODE_INDEX")


def container_name(attempts: int = 10) -> str:
    """Return this container's name: the embedded DNS's answer for its own address.

    Raises
    ------
    UserError
        No name after ``attempts`` tries, one second apart (not on a Docker network).
    """
    ips = [ip for ip in socket.gethostbyname_ex(socket.gethostname())[2]
           if not ip.startswith("127.")]
    server = (_nameserver(), 53)
    for attempt in range(attempts):
        for ip in ips:
            try:
                names = reverse_lookup(ip, server)
            except (OSError, ValueError):
                names = []
            if names:
                return names[0]
        if attempt + 1 < attempts:
            time.sleep(1.0)
    raise UserError(f"Docker's DNS ({server[0]}) gave no name for this container's address "
                    f"({', '.join(ips) or 'none'}); set NODE_INDEX to its index (0, 1, ...)")


def index_from_name(name: str) -> int:
    """Return the 0-based index of a replica named ``<project>-<service>-<n>[.<network>]``.

    Raises
    ------
    UserError
        ``name`` does not end in a replica number (a container given its own name).
    """
    match = re.fullmatch(r".*?[-_](\d+)", name.split(".")[0])
    if match is None or int(match.group(1)) < 1:
        raise UserError(f"container name {name!r} has no replica number "
                        "(<project>-<service>-<n>); set NODE_INDEX")
    return int(match.group(1)) - 1


def replica_index(env: dict[str, str]) -> tuple[int, str]:
    """Return this replica's 0-based index and its source: ``$NODE_INDEX`` or the name.

    Raises
    ------
    UserError
        ``NODE_INDEX`` is not an integer >= 0, or the name gives no index.
    """
    given = env.get("NODE_INDEX", "").strip()
    if given:
        if not given.isdigit():
            raise UserError(f"NODE_INDEX must be an integer >= 0, got {given!r}")
        return int(given), "NODE_INDEX"
    name = container_name()
    return index_from_name(name), name


def gpu_for(index: int, env: dict[str, str], dev: Path = Path("/dev")) -> int:
    """Return the GPU (CUDA ordinal) of replica ``index``: ``index mod GPUs``.

    GPUs: ``$NUM_GPUS``, else the ``/dev/nvidia<N>`` devices the container sees.

    Raises
    ------
    UserError
        No GPU is visible, or ``NUM_GPUS`` is not a positive integer.
    """
    given = env.get("NUM_GPUS", "").strip()
    if given and (not given.isdigit() or int(given) < 1):
        raise UserError(f"NUM_GPUS must be an integer >= 1, got {given!r}")
    count = int(given) if given else len([p for p in dev.glob("nvidia[0-9]*")])
    if count == 0:
        raise UserError("GPU_PER_NODE is set but this container sees no GPU (/dev/nvidia<N>): "
                        "install the NVIDIA Container Toolkit, or leave out compose.gpu.yml")
    return index % count


def command_line(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Return the command and environment ``run`` execs: ``{index}`` filled, ``$EXTRA_ARGS`` added.

    Raises
    ------
    UserError
        No command, ``EXTRA_ARGS`` that are not shell words, or no replica index to be had.
    """
    if not argv:
        raise UserError("run needs a command, e.g. run fedavg node --partition-id {index}")
    try:
        extra = shlex.split(env.get("EXTRA_ARGS", ""))
    except ValueError as exc:
        raise UserError(f"EXTRA_ARGS is not a list of shell words: {exc}") from None
    env = dict(env)
    if any(INDEX in a for a in argv) or env.get("GPU_PER_NODE"):
        index, source = replica_index(env)
        argv = [a.replace(INDEX, str(index)) for a in argv]
        note = f"replica {source}: index {index}"
        if env.get("GPU_PER_NODE"):
            env["CUDA_VISIBLE_DEVICES"] = str(gpu_for(index, env))
            note += f", GPU {env['CUDA_VISIBLE_DEVICES']}"
        print(note, flush=True)
    return [*argv, *extra], env


# ---- init ---------------------------------------------------------------------------------

def certs_fit(folder: Path, nodes: int, hosts: list[str]) -> bool:
    """Tell whether ``folder`` holds a CA, a coordinator certificate and node keys that fit.

    Fitting: the certificate is valid for every name in ``hosts``, and there are node keys
    ``node-0.key`` ... ``node-<nodes-1>.key`` and ``authorized-nodes.pub``.
    """
    from cryptography import x509

    needed = ["ca.key", "ca.crt", "coordinator.key", "coordinator.crt"]
    needed += [f"node-{i}.key" for i in range(nodes)] + (["authorized-nodes.pub"] if nodes else [])
    if not all((folder / name).is_file() for name in needed):
        return False
    try:
        cert = x509.load_pem_x509_certificate((folder / "coordinator.crt").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    names = {str(n) for n in san.get_values_for_type(x509.DNSName)}
    names |= {str(n) for n in san.get_values_for_type(x509.IPAddress)}
    return all(h in names for h in hosts)


def writable_by(st: os.stat_result, uid: int, gid: int) -> bool:
    """Tell whether a folder with stat ``st`` lets user ``uid`` (group ``gid``) create files."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & 0o300 == 0o300)
    if st.st_gid == gid:
        return bool(st.st_mode & 0o030 == 0o030)
    return bool(st.st_mode & 0o003 == 0o003)


def prepare_output(folder: Path, uid: int, gid: int) -> str:
    """Make ``folder`` writable by ``uid:gid`` if Docker just created it; say what was done.

    A bind-mounted folder that did not exist on the host is created by Docker, owned by root:
    it is handed to ``uid:gid`` when it is still empty. A folder of the host user's is never
    changed.

    Raises
    ------
    UserError
        ``folder`` is not writable by ``uid:gid`` and was not made by Docker.
    """
    folder.mkdir(parents=True, exist_ok=True)
    st = folder.stat()
    if writable_by(st, uid, gid):
        return f"{folder} is writable by {uid}:{gid}"
    if st.st_uid == 0 and not any(folder.iterdir()):
        os.chown(folder, uid, gid)
        return f"{folder} (new) handed to {uid}:{gid}"
    raise UserError(f"the output folder belongs to {st.st_uid}:{st.st_gid} and {uid}:{gid} "
                    "cannot write it: set FEDAVG_UID / FEDAVG_GID to its owner (id -u, id -g)")


def init(certs: Path, nodes: int, hosts: list[str], outputs: list[Path],
         owner: tuple[int, int]) -> None:
    """Make certificates unless ``certs`` holds fitting ones; hand them and ``outputs`` on.

    ``owner`` (uid, gid) gets the certificate files, and every output folder Docker created.

    Raises
    ------
    UserError
        Bad ``nodes`` or host names, or an output folder the owner cannot write.
    """
    # lazy: the image's health check stays light
    from fedavg.engines.deployment.certs import make_certs

    uid, gid = owner
    hosts = [h for h in dict.fromkeys(hosts) if h]
    if certs_fit(certs, nodes, hosts):
        print(f"certificates in {certs} kept (valid for {', '.join(hosts) or 'localhost'}, "
              f"{nodes} node keys)", flush=True)
    else:
        make_certs(certs, hosts=hosts, nodes=nodes, overwrite=True)
        print(f"certificates made in {certs} for {', '.join(hosts) or 'localhost'}, "
              f"{nodes} node keys", flush=True)
    for path in [certs, *certs.iterdir()]:
        os.chown(path, uid, gid)
    for folder in outputs:
        print(prepare_output(folder, uid, gid), flush=True)


def _owner(text: str) -> tuple[int, int]:
    uid, _, gid = text.partition(":")
    if not (uid.isdigit() and gid.isdigit()):
        raise argparse.ArgumentTypeError(f"expected UID:GID, got {text!r}")
    return int(uid), int(gid)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fedavg.engines.deployment.containers",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("health", help="the image's health check")
    run = sub.add_parser("run", help="exec a command with {index} and $EXTRA_ARGS filled in")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    ini = sub.add_parser("init", help="certificates and folder owners of a compose stack")
    ini.add_argument("--certs", type=Path, required=True)
    ini.add_argument("--nodes", type=int, default=0)
    ini.add_argument("--host", action="append", default=[],
                     help="host names of the coordinator, comma-separated; repeatable")
    ini.add_argument("--output", type=Path, action="append", default=[])
    ini.add_argument("--owner", type=_owner, default=(1000, 1000), help="UID:GID")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a ``UserError`` is one line on stderr and exit code 2."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "health":
            return health()
        if args.command == "init":
            hosts = [h.strip() for arg in args.host for h in re.split(r"[,\s]+", arg)]
            init(args.certs, args.nodes, hosts, args.output, args.owner)
            return 0
        command, env = command_line(args.argv, dict(os.environ))
        sys.stdout.flush()
        os.execvpe(command[0], command, env)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0  # not reached: execvpe replaces this process


if __name__ == "__main__":
    sys.exit(main())
