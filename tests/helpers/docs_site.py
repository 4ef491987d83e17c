"""The docs site as the tests build it: in this process, with ``mkdocs build --strict``'s rules.

Built in-process, the generated reference pages see what this test process registered (a
throwaway strategy, say), exactly as a build after adding it to the code would.
"""

import os
from pathlib import Path

from helpers.cli import ROOT

# MkDocs 1.6 and Material print a banner about MkDocs 2 on every build; these silence it
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def build_site(site_dir: Path) -> Path:
    """Build the docs into ``site_dir`` with warnings as errors; return ``site_dir``.

    Raises
    ------
    mkdocs.exceptions.Abort
        A warning in strict mode: a broken link, a missing page or reference.
    """
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    os.environ.update(QUIET)
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True)
    config.plugins.on_startup(command="build", dirty=False)
    try:
        build(config)
    finally:
        config.plugins.on_shutdown()
    return site_dir


def page(site_dir: Path, path: str) -> str:
    """Return the built HTML of the page at ``path`` (``reference/cli``) of the site."""
    return (site_dir / path / "index.html").read_text()
