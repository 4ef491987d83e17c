"""What the SuperLink's and SuperNode's output lines mean (as of :data:`FLOWER_VERSION`).

Every Flower log line fedavg reacts to is recognised here, and nowhere else.
:func:`~fedavg.flower_compat.check_flower_internals` checks that Flower still writes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: A node's refusal for a TLS certificate it cannot verify (signer or name).
TLS_REFUSAL = ("the coordinator's TLS certificate is not signed by --certs/ca.crt or does not "
               "name this address; use the ca.crt of the coordinator's `fedavg certs` folder")
_REFUSED = (
    (re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|unknown ca|"
                r"hostname mismatch|IP address mismatch", re.I), TLS_REFUSAL),
    (re.compile(r"SuperNodes must be registered", re.I),
     "the coordinator only accepts known nodes: pass --auth-key with a node key listed in "
     "its --auth-keys"),
    (re.compile(r"Failed to activate SuperNode|PERMISSION_DENIED|UNAUTHENTICATED|"
                r"Public key not recognized", re.I),
     "the coordinator refused this node's key: add its public key to the coordinator's "
     "--auth-keys, or pass the right --auth-key"),
)
#: What to do about a node's key: one hint for both sides.
KEY_HINT = "give each node its own key (node-<i>.key from `fedavg certs --nodes N`)"
_SUPERLINK_REFUSAL = re.compile(
    r"\[ApiError:(\d+)\] Attempted to register SuperNode with public key: b'[^']*'"
    r"(?:, exception: (.*))?$")
#: Flower's ``ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED`` (checked by
#: :func:`~fedavg.flower_compat.check_flower_internals`).
_REGISTRATION_DISABLED = 2001
_RETRY = re.compile(r"Connection attempt failed, retrying in ([\d.]+)")
_NOTABLE = re.compile(r"Connection successful|Giving up|could not establish|Errno")


#: An HTTP server's answer to the SuperNode's first request (httpx's wording), where that
#: answer means "no SuperLink of this Flower version here".
_NOT_A_SUPERLINK = re.compile(r"(?:Server|Client) error '(400|404|405|501) (.*?)' for url")


def node_refusal(line: str) -> str | None:
    """Say clearly why the coordinator refused the node, if a SuperNode output line says so."""
    for pattern, reason in _REFUSED:
        if pattern.search(line):
            return reason
    if answer := _NOT_A_SUPERLINK.search(line):
        return (f"the server there answered HTTP {answer.group(1)} ({answer.group(2)}) to the "
                "node: it is no fedavg coordinator, or one of another Flower version; fix "
                "--coordinator")
    return None


def is_certificate_failure(text: str) -> bool:
    """Whether an error text says that TLS verification of a certificate failed."""
    return "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text


def superlink_line_is_error(line: str) -> bool:
    """Whether a SuperLink output line is an error worth showing to the user."""
    return bool(re.search(r"ERROR|address already in use|Errno", line)) \
        and "ClientDisconnect" not in line


def superlink_node_refusal(line: str) -> str | None:
    """Say in one line why the SuperLink refused a SuperNode, if its output ``line`` says so.

    Flower logs the node's whole public key (PEM) with the reason; this keeps the reason.

    Returns
    -------
    str or None
        The message; ``""`` for a line not worth showing (a node checking whether its key is
        registered, :func:`~fedavg.flower_compat.node_key_registered`); ``None``: not such
        a line.
    """
    m = _SUPERLINK_REFUSAL.search(line)
    if m is None:
        return None
    why = m.group(2) or ""
    node = re.search(r"SuperNode with node ID (\d+) could not be activated", why)
    if node:
        return f"refused a node whose key is already in use by connected node {node.group(1)}: "\
               + KEY_HINT
    if "No SuperNode found with the given public key" in why:
        return "refused a node whose key is not in --auth-keys"
    if "Heartbeat interval" in why:
        return ""
    if m.group(1) == str(_REGISTRATION_DISABLED):  # a node without a key
        return "refused a node without a key: start each node with --auth-key"
    return f"refused a node: {why or 'Flower error ' + m.group(1)}"[:200]


def most_telling_line(lines: Iterable[str]) -> str | None:
    """Pick the latest error among a Flower process's output lines, else the last line."""
    lines = list(lines)
    for line in reversed(lines):
        if "ERROR" in line or "Error" in line or "error" in line:
            return line.split(":", 1)[-1].strip() if line.startswith(("ERROR", "WARNING")) \
                else line.strip()
    return lines[-1].strip() if lines else None


@dataclass(frozen=True)
class SuperNodeLine:
    """What one line of SuperNode output says, as far as ``fedavg node`` cares.

    ``refusal``: why the coordinator refused the node (:func:`node_refusal`); ``key_refused``:
    it refused the node's key (possibly not yet registered); ``exit_code``: Flower is shutting
    the SuperNode down; ``attempt_failed`` / ``retry_in_s``: a connection attempt failed (and
    is retried after so many seconds); ``reconnected``: one succeeded after failures;
    ``node_id``: the SuperLink registered the node; ``dropped``: the server closed the
    connection unanswered (TLS against plain HTTP?); ``gave_up``: the SuperNode stopped
    retrying (``--max-wait-time``); ``started``: the SuperNode is up and starts connecting;
    ``notable``: worth showing as :attr:`message`.
    """

    text: str
    refusal: str | None = None
    key_refused: bool = False
    exit_code: int | None = None
    attempt_failed: bool = False
    retry_in_s: float | None = None
    reconnected: bool = False
    node_id: str | None = None
    dropped: bool = False
    gave_up: bool = False
    started: bool = False
    notable: bool = False

    @property
    def message(self) -> str:
        """The line without its log prefix."""
        return self.text.split(":", 1)[-1].strip()


def parse_supernode_line(line: str) -> SuperNodeLine:
    """Read one (ANSI-free) line of SuperNode output."""
    exit_code = re.search(r"Exit Code: (\d+)", line)
    retry = _RETRY.search(line)
    return SuperNodeLine(
        text=line,
        refusal=node_refusal(line),
        key_refused="Failed to activate" in line,
        exit_code=int(exit_code.group(1)) if exit_code else None,
        attempt_failed="Connection attempt failed" in line,
        retry_in_s=float(retry.group(1)) if retry else None,
        reconnected="Connection successful" in line,
        node_id=line.rsplit(":", 1)[-1].strip() if "SuperNode ID" in line else None,
        dropped="disconnected without sending a response" in line,
        gave_up="Giving up" in line,
        started="Starting Flower SuperNode" in line,
        notable=bool(_NOTABLE.search(line)),
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOWER_REASON = re.compile(r"^<class '([\w.]+)'>:<'(.*)'>$", re.S)
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (\S.*)$")


def error_summary(reason: str) -> str:
    """One line from a node's error report: the original exception type and message.

    Flower wraps a node's exception (in simulation, inside Ray's) with tracebacks, as
    ``<class 'X'>:<'message'>`` or a traceback text; this keeps
    the innermost ``SomeError: message`` line, e.g. ``FloatingPointError: training diverged``.
    """
    text = _ANSI.sub("", reason or "")
    flower = _FLOWER_REASON.match(text.strip())  # a ClientApp's exception, as Flower wraps it
    if flower:
        return f"{flower.group(1).rsplit('.', 1)[-1]}: {' '.join(flower.group(2).split())}"[:300]
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _EXC_LINE.match(line.strip())
        if m and not m.group(1).startswith(("flwr.", "ray.")):
            said = m.group(2)
            if said.rstrip().endswith(":"):  # announces the next line (load_state_dict's)
                said += " " + next((ln.strip() for ln in lines[i + 1:] if ln.strip()), "")
            return f"{m.group(1).rsplit('.', 1)[-1]}: {said.strip()}"[:300]
    if "Message:" in text:
        return text.rsplit("Message:", 1)[1].strip().strip("'>").strip()[:300]
    first = next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")
    return first[:300]
