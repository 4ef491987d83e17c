"""The docs site: it builds strictly, its references are generated, the README stays short."""

import re
from pathlib import Path

import click
import pytest
import typer
from helpers.cli import ROOT
from helpers.docs_site import build_site, page

from fedavg.cli.app import app
from fedavg.cli.reference import cli_markdown, models_markdown, strategies_markdown

NAV_PAGES = re.findall(r":\s+([\w/-]+)\.md$", (ROOT / "mkdocs.yml").read_text(), re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))


def test_every_page_of_the_nav_is_built(site):
    assert len(NAV_PAGES) > 30
    for name in NAV_PAGES:
        folder = name.removesuffix("index")  # results/index.md is results/index.html
        path = site / folder / "index.html"
        assert path.is_file(), name
        assert "<h1" in path.read_text(), name


def test_the_cli_reference_has_every_command_and_option():
    text = cli_markdown(app)
    group = typer.main.get_command(app)
    root = click.Context(group, info_name="fedavg")
    for name in group.list_commands(root):
        assert f"## `fedavg {name}`" in text
        command = group.get_command(root, name)
        section = text.split(f"## `fedavg {name}`")[1].split("\n## ")[0]
        for param in command.params:
            if isinstance(param, click.Option):
                assert f"`{param.opts[0]}`" in section, (name, param.opts)
            else:
                assert param.human_readable_name in section, (name, param.name)
    assert "| `--num-nodes` | INTEGER | `5` |" in text
    assert "| `--save-node-models` | flag |" in text


def test_the_built_references_show_the_registries(site):
    cli = page(site, "reference/cli")
    for command in ("simulate", "merge", "coordinator", "node", "sweep", "report"):
        assert f"fedavg {command}" in cli
    strategies_page = page(site, "reference/strategies")
    for name in ("fedavg", "scaffold", "ties", "fisher", "distill"):
        assert f'id="{name}"' in strategies_page, name
    assert "arXiv:2306.01708" in strategies_page  # TIES's paper
    models = page(site, "reference/models")
    assert "efficientnet-lite0" in models and "torchvision:NAME" in models
    python = page(site, "reference/python")
    for name in ("simulate", "load_model", "predict", "merge_models", "RunConfig"):
        assert re.search(rf'id="fedavg\.[\w.]*\.{name}"', python), name
    for built in (python, page(site, "explanation/wire")):  # Sphinx roles shown as code
        assert not re.search(r":(func|class|meth|mod|data):`", built)


def test_the_results_pages_come_from_experiments(site):
    sources = sorted((ROOT / "experiments" / "results").glob("*.md"))
    assert sources
    for source in sources:
        assert (site / "results" / source.stem / "index.html").is_file(), source.name
    plots = sorted((ROOT / "experiments" / "results").rglob("*.png"))
    for plot in plots:
        built = site / "results" / plot.relative_to(ROOT / "experiments" / "results")
        assert built.read_bytes() == plot.read_bytes()


def test_markdown_cells_escape_pipes():
    text = strategies_markdown()
    for line in text.splitlines():
        if line.startswith("| [`"):
            assert line.count(" | ") + line.count("|---") >= 3
    assert "(default) | fasttext for text" in models_markdown()


def test_the_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert len(local) > 15
    for link in local:
        assert (ROOT / link).is_file(), link


# Flags of other tools that the hand-written pages show (and of the benchmark scripts)
OTHER_TOOLS = {
    "pip": {"--index-url"}, "pytest": {"--dist"}, "hadolint": {"--failure-threshold"},
    "mkdocs": {"--strict"}, "kubectl": {"--for", "--timeout"},
    "mlflow": {"--backend-store-uri"}, "tensorboard": {"--logdir"},
    "ray start": {"--head", "--port", "--node-ip-address", "--disable-usage-stats"},
    "docker": {"--build-arg", "--rm", "--shm-size", "--user"},
    "flower-superlink / flower-supernode": {"--isolation", "--node-config", "--simulation"},
    "experiments/*.py": {"--against", "--recipe", "--repeats", "--runs", "--shares"},
    "development.md's example strategy": {"--scale"},
}


def hand_written_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_option_and_command_the_docs_name_exists():
    group = typer.main.get_command(app)
    root = click.Context(group, info_name="fedavg")
    commands = set(group.list_commands(root))
    options = {"--help", "--version"}
    for name in commands:
        for param in group.get_command(root, name).params:
            options.update(getattr(param, "opts", []) + getattr(param, "secondary_opts", []))
    options.update(*OTHER_TOOLS.values())
    import strategies

    names = set(strategies.available())
    for path in hand_written_pages():
        text = path.read_text()
        unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - options
        assert not unknown, f"{path.relative_to(ROOT)} names options no command has: {unknown}"
        used = set(re.findall(r"`fedavg ([a-z]+)\b", text)) | \
            set(re.findall(r"^fedavg ([a-z]+)\b", text, re.M))
        assert used <= commands, f"{path.relative_to(ROOT)}: no command {used - commands}"
        strategy_names = set(re.findall(r"--strategy ([a-z][a-z-]*)", text))
        assert strategy_names <= names, f"{path.relative_to(ROOT)}: {strategy_names - names}"
