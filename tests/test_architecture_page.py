"""docs/architecture.md is the project's one architecture page; these checks keep it true.

Every module of proctor's four packages is in its map, every path it names exists, every package
has its section, and its table of the server's layers is the one `test_structure` enforces.
"""

from __future__ import annotations

import re

from test_structure import MODULES, ROOT, SERVER_LAYERS, _generated

PAGE = ROOT / "docs" / "architecture.md"


def _page() -> str:
    return PAGE.read_text()


def _mapped_paths(text: str) -> set[str]:
    """The module paths in the map's table rows (first column)."""
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.MULTILINE))


def _modules_on_disk() -> set[str]:
    return {str(path.relative_to(ROOT)) for path in MODULES.values()
            if not _generated(path) and path.name != "__init__.py"}


def test_every_module_is_in_the_map():
    missing = sorted(_modules_on_disk() - _mapped_paths(_page()))
    assert len(_modules_on_disk()) > 100  # the walk found the real modules
    assert missing == []


def test_every_path_the_page_names_exists():
    named = set(re.findall(r"`((?:server|client|proto|trainer_adapter|tests|bench|deploy|scripts|docs)/[\w/.-]*)`",
                           _page()))
    assert len(named) > 100
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


def test_every_package_has_its_section():
    packages = {str(path.parent.relative_to(ROOT)) for path in MODULES.values() if path.name == "__init__.py"}
    headings = set(re.findall(r"^### `([\w/]+)/`$", _page(), flags=re.MULTILINE))
    assert sorted(packages - headings - {"server"}) == []  # the server root is a bare package


def test_the_layers_table_is_the_enforced_one():
    rows = re.findall(r"^\| (\d+) \| `(server/[\w/.]+)` \|", _page(), flags=re.MULTILINE)
    listed = [("proctor." + path.removesuffix(".py").rstrip("/").replace("/", ".")) for _, path in rows]
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1))
    assert listed == list(SERVER_LAYERS)


def test_a_module_missing_from_the_map_is_caught():
    text = _page().replace("| `server/front/service.py` |", "| service |")
    assert "server/front/service.py" in _modules_on_disk() - _mapped_paths(text)
