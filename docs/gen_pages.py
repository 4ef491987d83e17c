"""Pages generated at every ``mkdocs build`` (the mkdocs-gen-files plugin runs this file).

- ``reference/cli.md``, ``reference/strategies.md``, ``reference/models.md``: from the code
  itself (:mod:`fedavg.cli.reference`), so they cannot drift from ``fedavg --help``.
- ``results/*``: the benchmark result pages and their plots, from ``experiments/results/``
  (one copy, in the repository; the site shows it).
"""

from pathlib import Path

import mkdocs_gen_files

from fedavg.cli.app import build_app
from fedavg.cli.reference import cli_markdown, models_markdown, strategies_markdown

ROOT = Path(__file__).resolve().parent.parent

for name, text in (("cli", cli_markdown(build_app())), ("strategies", strategies_markdown()),
                   ("models", models_markdown())):
    with mkdocs_gen_files.open(f"reference/{name}.md", "w") as page:
        page.write(text)
    mkdocs_gen_files.set_edit_path(f"reference/{name}.md", "../fedavg/cli/reference.py")

results = ROOT / "experiments" / "results"
for path in sorted(results.rglob("*")):
    if path.is_file() and path.suffix in (".md", ".png", ".csv"):
        with mkdocs_gen_files.open(f"results/{path.relative_to(results)}", "wb") as copy:
            copy.write(path.read_bytes())
