"""Errors that mean "the user asked for something we cannot do".

The CLI prints them as one line (``error: ...``) and exits with code 2, without a traceback.
Anything else is a bug and keeps its traceback.
"""

import errno
import re

#: What a full, read-only or forbidden place to write says (errno).
DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EFBIG)


class UserError(Exception):
    """A mistake in the input (path, column, option value) with a message saying what to fix."""


class NoLabelColumn(UserError):
    """A dataset with no column that could be its labels."""


class RunError(Exception):
    """A run could not finish (e.g. no node replied in a round); artifacts so far are kept.

    ``resume_without`` names the options (``--max-update-norm``) that caused the failure:
    the printed resume command leaves them out, since with them it would fail the same way.
    """

    def __init__(self, message: str = "", *, resume_without: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.resume_without = resume_without


class CommandError(RunError):
    """A command failed for a reason outside its input, and no run failed (``error:``, exit 1).

    A node that never reached its coordinator: it joined no run.
    """

    label = "error"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """Return the first line of ``exc``'s message (its type name when empty), cut to ``limit``.

    A first line that only announces the next (``Error(s) in loading state_dict for
    Sequential:``) is followed by that line.
    """
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__[:limit]
    return (" ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1
            else lines[0])[:limit]


_SETTING = re.compile(r"setting '([a-z][a-z0-9-]*)'")
#: A flag, not a path's folder (``--odd/run``), with the value it is given, if one a Python
#: argument takes as is: a placeholder (``N``, ``DATASET``), a number or a path.
_FLAG = re.compile(r"(?<![\w./-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w/-]|\.\w)"
                   r"(?: ([A-Z][A-Z_]*\b|[-+]?\d[\w.+-]*|[^\s;,()]*[/:][^\s;,()]*))?")
#: A shell command in a message (``fedavg simulate --resume DIR``) stays as written.
_COMMAND = re.compile(r"`?fedavg (?:simulate|merge|evaluate|predict|strategies|models|"
                      r"coordinator|node|certs|sweep|report)\b[^;`]*`?")
#: CLI flags whose Python argument has another name.
_RENAMED = {"model-arg": "model_args"}


def python_names(message: str) -> str:
    """Name settings in ``message`` as Python arguments: ``--label-column`` as ``label_column``.

    For errors raised through the Python API (``fedavg.simulate(mu=...)``), whose messages
    are written for the CLI: ``--rounds N`` reads ``rounds=N``, a TOML key (``setting
    'num-nodes'``) ``setting 'num_nodes'``; a shell command quoted in it stays as written.
    """
    def flag(m: re.Match) -> str:
        name = _RENAMED.get(m.group(1), m.group(1).replace("-", "_"))
        return f"{name}={m.group(2)}" if m.group(2) else name

    def plain(text: str) -> str:
        text = _SETTING.sub(lambda m: f"setting '{m.group(1).replace('-', '_')}'", text)
        return _FLAG.sub(flag, text)

    out, last = [], 0
    for command in _COMMAND.finditer(message):
        out += [plain(message[last:command.start()]), command.group(0)]
        last = command.end()
    return "".join(out) + plain(message[last:])
