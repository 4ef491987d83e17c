"""A griffe extension for the Python API pages: Sphinx roles in docstrings as code.

The docstrings name other objects the way Sphinx does (``:func:`fedavg.load_model```,
``:class:`~flwr.app.ArrayRecord```), which mkdocstrings would show as they are written. This
shows each as the object's name in code font (``fedavg.load_model``, ``ArrayRecord`` for a
``~`` name).
"""

import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles as code."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
