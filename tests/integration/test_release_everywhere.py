"""The release is written once (``raven/__init__.py``'s ``__version__``) and everything that names it follows.

A first deployment asks for the image ``scripts/image.sh`` built: every image tag in the manifests (``image:``
lines and kustomizations' ``newTag:``), every ``raven-tunnel:<release>`` in the docs and scripts, and every
rendered kustomization's Raven containers name this release; pyproject.toml takes its version from the same
place, and what the docs show ``raven --version`` printing is what it prints.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from raven import __version__
from raven.version import describe
from tests.support import schemas
from tests.support.paths import ROOT

# Where a release is named for people or for a cluster (certs/dev and the like are ignored by git: not listed).
SCANNED = ("deploy", "certs", "docs", "scripts", "README.md", "Dockerfile")
TEXT = (".md", ".yaml", ".yml", ".sh", ".py", ".json", ".txt", "")
# The forms a release takes there (the repository's hook greps the same two).
TAG = re.compile(r"raven-tunnel:([0-9][0-9A-Za-z.+_-]*)")
NEW_TAG = re.compile(r"newTag:\s*[\"']?([0-9][0-9A-Za-z.+_-]*)")
# The docs may show either build's line (the image and setup.sh install the compiled one, RAVEN_COMPILE=0 the pure
# one): the release and the protocols must be this checkout's.
EITHER_BUILD = {describe().rsplit("; ", 1)[0] + f"; {b} build)" for b in ("compiled", "pure")}
PRINTED = re.compile(r"raven [0-9][0-9A-Za-z.+_-]* \([^)\n]*protocol[^)\n]*\)")  # what `raven --version` prints


def _files() -> list[Path]:
    """The tracked (and new, not ignored) text files under SCANNED."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode == 0:
        paths = [ROOT / line for line in listed.stdout.splitlines() if line]
    else:  # not a git checkout (an unpacked archive): every file, but what git would ignore here
        paths = [p for name in SCANNED for p in ([ROOT / name] if (ROOT / name).is_file() else
                                                 (ROOT / name).rglob("*"))
                 if not {"dev", "node_modules", "__pycache__"} & set(p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.is_file() and (p.suffix in TEXT or p.name == "Dockerfile"))


def test_every_image_tag_and_doc_names_this_release() -> None:
    found: list[tuple[str, int, str]] = []
    wrong: list[str] = []
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in (TAG, NEW_TAG):
                for m in pattern.finditer(line):
                    found.append((str(path.relative_to(ROOT)), number, m.group(1)))
                    if m.group(1) != __version__:
                        wrong.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)} (the release is {__version__})")
            for m in PRINTED.finditer(line):
                if m.group(0) not in EITHER_BUILD:
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}; `raven --version` prints "
                                 f"{describe()!r}")
    assert not wrong, "\n".join(wrong)
    # The scan saw what it is there for: both bases' and every overlay's tags, the layer-3 routes DaemonSet,
    # deploy/README.md's step 0 and docs/image.md.
    named = {f for f, _, _ in found}
    assert {"deploy/base/daemonset.yaml", "deploy/base/kustomization.yaml", "deploy/agent/base/deployment.yaml",
            "deploy/agent/base/kustomization.yaml", "deploy/overlays/production/kustomization.yaml",
            "deploy/overlays/deployment/deployment.yaml", "deploy/agent/overlays/pool-a/kustomization.yaml",
            "deploy/agent/components/layer3/routes-daemonset.yaml", "deploy/README.md", "docs/image.md"} <= named


def _kustomizations() -> list[Path]:
    out = []
    for root in (ROOT / "deploy", ROOT / "certs" / "manifests"):
        for path in sorted(root.rglob("kustomization.yaml")):
            if (ROOT / "deploy" / "examples") in path.parents:
                continue
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
            if not any(d.get("kind") == "Component" for d in docs):
                out.append(path.parent)
    return out


def _raven_images(doc: dict[str, Any]) -> list[str]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if isinstance(spec, dict) else {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", [])]
    return [c["image"] for c in containers if "raven-tunnel" in c.get("image", "")]


@pytest.mark.integration
def test_every_rendered_raven_container_runs_this_release() -> None:
    images: dict[str, list[str]] = {}
    for directory in _kustomizations():
        for doc in schemas.render(directory):
            for image in _raven_images(doc):
                images.setdefault(image, []).append(f"{directory.relative_to(ROOT)}: {doc['kind']}/"
                                                    f"{doc['metadata']['name']}")
    assert images, "no kustomization renders a Raven container"
    wrong = {image: where for image, where in images.items() if image.rpartition(":")[2] != __version__}
    assert not wrong, f"containers that do not run {__version__}: {wrong}"


def test_the_release_is_written_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "raven.__version__"}
    # scripts/image.sh reads the tag with sed from this exact form.
    init = (ROOT / "raven" / "__init__.py").read_text()
    assert re.findall(r'^__version__ = "(.*)"$', init, re.MULTILINE) == [__version__]
