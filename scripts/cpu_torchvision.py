"""Give a CPU-only torch a working torchvision (its Python layer), for the multimodal teachers.

Why: transformers' Qwen2-VL / Qwen2.5-Omni processors and vLLM's `qwen2_vl.py` (which every
Qwen VL and omni Thinker model file of vLLM imports) need `torchvision` for its image and video
transforms, which are plain torch code. The package index only carries torchvision builds
linked against CUDA torch: beside the CPU torch their compiled extension (`torchvision/_C.so`:
nms, roi_align, deform_conv, none of which these models use) cannot load, and that alone breaks
`import torchvision`, because two of its fake-kernel registrations (`torchvision::nms`,
`torchvision::qnms`) are not guarded by `extension._has_ops()` as all its others are.

What it does, only when `import torchvision` fails beside a `+cpu` torch: install the
torchvision release built for this torch (`--no-deps`, so torch stays the CPU build), then
guard those two registrations the way torchvision guards the rest. The transforms then run on
the CPU exactly as in a CPU build; the compiled detection ops raise if ever called. On a CUDA
or NPU install this script does nothing: the normal wheel works there.

Usage: `python scripts/cpu_torchvision.py` (scripts/install.sh runs it).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

# torchvision's release for each torch release (torchvision's own compatibility table).
TORCHVISION_FOR_TORCH = {"2.9": "0.24.1", "2.10": "0.25.0", "2.11": "0.26.0", "2.12": "0.27.0",
                         "2.13": "0.28.0", "2.14": "0.29.1"}
UNGUARDED = re.compile(r"^@torch\.library\.register_fake\(", re.MULTILINE)
GUARDED = "@(lambda fn: fn) if not torchvision.extension._has_ops() else torch.library.register_fake("


def imports_cleanly() -> bool:
    probe = "import torchvision, torchvision.transforms.v2.functional"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torchvision").split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def guard_registrations(package_dir: Path) -> bool:
    """Guard torchvision's unconditional fake registrations; True when the file changed."""
    path = package_dir / "_meta_registrations.py"
    text = path.read_text()
    patched = UNGUARDED.sub(lambda _: GUARDED, text)
    if patched == text:
        return False
    path.write_text(patched)
    return True


def main() -> int:
    import torch

    if "+cpu" not in torch.__version__:
        print(f"torch {torch.__version__} is not a CPU build: the normal torchvision wheel applies")
        return 0
    if importlib.util.find_spec("torchvision") is not None and imports_cleanly():
        print("torchvision imports cleanly")
        return 0
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    version = TORCHVISION_FOR_TORCH.get(release)
    if version is None:
        print(f"no known torchvision release for torch {release}", file=sys.stderr)
        return 1
    if installed_version() != version:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        f"torchvision=={version}"], check=True)
    spec = importlib.util.find_spec("torchvision")
    assert spec is not None and spec.origin is not None
    guard_registrations(Path(spec.origin).parent)
    if not imports_cleanly():
        print("torchvision still fails to import beside the CPU torch", file=sys.stderr)
        return 1
    print(f"torchvision {version}: Python transforms on the CPU torch (compiled detection ops unavailable)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
