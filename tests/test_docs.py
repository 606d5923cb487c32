"""The documentation site builds strictly, a broken link fails its build, and the pages keep
to what they are for: the performance page shows the benchmark report's headline, and no
page carries a commit hash.

The examples of the pages run in tests/test_readme.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from conftest import ROOT

DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"


def bench_hook() -> ModuleType:
    path = DOCS / "_hooks" / "bench_report.py"
    spec = importlib.util.spec_from_file_location("bench_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.mark.slow  # a few seconds: mkdocstrings reads the SDK's sources
@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = build(CONFIG, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in (
        "posenc.Client.get_range",
        "posenc.Client.get_positions",
        "posenc.AsyncClient.iter_range",
        "posenc.Spec.from_config",
        "posenc.GrowingTable.get",
        "posenc.InvalidArgumentError",
        "posenc.integrations.transformers.patch",
    ):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"
    performance = (site / "performance" / "index.html").read_text()
    assert "bench-headline" not in performance, "the headline table was not put in"
    rows = re.findall(r"<tr>", performance)
    assert len(rows) >= len(headline_rows()) + 1
    assert (site / "performance" / "report" / "index.html").exists()
    assert (site / "pictures" / "drift-rotary.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strict build is what catches broken internal links: prove it does."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs, symlinks=False)
    page = docs / "guide" / "sdk.md"
    page.write_text(
        page.read_text()
        + "\nSee [nowhere](no-such-page.md) and [no anchor](cli.md#no-such-section).\n"
    )
    config = yaml.safe_load(CONFIG.read_text())
    config.update(
        docs_dir=str(docs),
        hooks=[str(DOCS / "_hooks" / "bench_report.py")],
    )
    handler = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(ROOT / "client")]
    broken = tmp_path / "mkdocs.yml"
    broken.write_text(yaml.safe_dump(config))
    result = build(broken, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "no-such-page.md" in output and "no-such-section" in output, output


def headline_rows() -> list[str]:
    report = (ROOT / "bench" / "results" / "latest.md").read_text()
    return bench_hook().headline(report).splitlines()[2:]


def test_the_headline_is_the_reports_targets() -> None:
    """Every row of the report's Targets table that has a target, and no other."""
    report = (ROOT / "bench" / "results" / "latest.md").read_text()
    targets = report.split("\n## Targets\n", 1)[1].strip().split("\n\n")[0].splitlines()[2:]
    wanted = [row for row in targets if row.split("|")[4].strip()]
    assert wanted and headline_rows() == wanted
    page = (DOCS / "performance.md").read_text()
    assert bench_hook().MARKER in page
    assert "](performance/report.md)" in page


def test_every_page_is_in_the_navigation() -> None:
    nav = yaml.safe_load(CONFIG.read_text())["nav"]

    def pages(entries: object) -> list[str]:
        if isinstance(entries, str):
            return [entries]
        if isinstance(entries, dict):
            return [page for value in entries.values() for page in pages(value)]
        assert isinstance(entries, list)
        return [page for entry in entries for page in pages(entry)]

    listed = set(pages(nav))
    written = {
        str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md") if "_hooks" not in path.parts
    }
    assert written <= listed, f"pages missing from the nav: {sorted(written - listed)}"


# A commit hash: 7 to 40 hex digits with at least one letter and one digit.
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_no_page_names_a_commit() -> None:
    """History lives in git and CHANGELOG.md's entries, not in commit references."""
    paths = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"]
    paths += [path for path in DOCS.rglob("*.md")]
    found = {
        str(path.relative_to(ROOT)): HASH.findall(path.read_text())
        for path in paths
        if HASH.search(path.read_text())
    }
    assert not found, f"commit hashes in {found}"


def test_the_figures_page_shows_every_picture_make_plots_draws() -> None:
    spec = importlib.util.spec_from_file_location("make_plots", ROOT / "scripts" / "make_plots.py")
    assert spec is not None and spec.loader is not None
    make_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plots)
    page = (DOCS / "figures.md").read_text()
    for name in make_plots.PICTURES:
        assert (DOCS / "pictures" / f"{name}.png").exists(), name
        assert f"](pictures/{name}.png)" in page, name


def test_the_accuracy_page_shows_the_readmes_drift_table() -> None:
    """tests/test_conformance.py measures the README's drift table; the accuracy page shows
    the same one."""

    def table(text: str) -> str:
        return text[text.index("| reference (float32) |") :].split("\n\n", 1)[0]

    readme = (ROOT / "README.md").read_text()
    assert table((DOCS / "guide" / "accuracy.md").read_text()) == table(readme)


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```sh\n(.*?)^ *```", text, flags=re.DOTALL | re.MULTILINE)


def test_recipes_name_make_targets_that_exist() -> None:
    """The ```sh recipes do not run in the tests; the make targets they name exist."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.MULTILINE))
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.rglob("*.md")]
    named = {
        (str(path.relative_to(ROOT)), target)
        for path in pages
        for block in sh_blocks(path.read_text())
        for target in re.findall(r"^\s*make ([a-z][a-z-]*)", block, flags=re.MULTILINE)
    }
    assert named, "no make command found"
    missing = sorted((page, target) for page, target in named if target not in targets)
    assert not missing, f"make targets that do not exist: {missing}"


def test_the_podman_recipe_runs_the_compose_files_replicas() -> None:
    """The deployment guide's podman commands give each replica, and Prometheus, what
    docker-compose.yml gives them: the same replicas, environment, memory, grace and
    hardening."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    service = services["posenc"]
    guide = (DOCS / "guide" / "deployment.md").read_text()
    recipe = next(block for block in sh_blocks(guide) if "--network-alias posenc" in block)
    replicas = service["deploy"]["replicas"]
    assert f"for i in {' '.join(str(i) for i in range(1, replicas + 1))}; do" in recipe
    image_defaults = {"POSENC_HOST", "POSENC_PORT", "POSENC_METRICS_HOST", "POSENC_METRICS_PORT"}
    for key, value in service["environment"].items():
        if key not in image_defaults:
            assert f"-e {key}={value}" in recipe, key
    limit = service["deploy"]["resources"]["limits"]["memory"]
    assert f"--memory {limit}" in recipe
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert f"--stop-timeout {grace}" in recipe
    assert f"--user {service['user']}" in recipe
    for cap in service["cap_drop"]:
        assert f"--cap-drop {cap}" in recipe
    for option in service["security_opt"]:
        assert f"--security-opt {option}" in recipe
    assert "--read-only" in recipe and "--tmpfs /tmp" in recipe
    assert f"posenc:1.0.0 {' '.join(service['command'])}" in recipe
    assert service["image"] == "posenc:1.0.0"
    # Prometheus runs as the compose file runs it: its image, flags, user and memory.
    prometheus = services["prometheus"]
    assert f"{prometheus['image']} \\" in recipe
    for flag in prometheus["command"]:
        assert flag in recipe, flag
    assert f"--user {prometheus['user']}" in recipe
    assert f"--memory {prometheus['deploy']['resources']['limits']['memory']}" in recipe
