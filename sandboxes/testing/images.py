"""Container images for the container provider's tests, built here (no image registry is reachable):
a Debian base from Debian's package registry with mmdebstrap, imported into podman, and a second image
with a marker file baked in. Each is tagged by a content key of what builds it, so a second CI run on the
same machine finds them built; a lock makes concurrent test processes build each once.

    python -m sandboxes.testing.images      # build (or find) both, print their tags
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"
INCLUDE = ("python3", "git", "ca-certificates")
MARKER_PATH = "/etc/rollout-image-marker"
MARKER_TEXT = "marker-image"
BUILD_TIMEOUT_S = 600.0
_RECIPE_VERSION = "1"  # bump when the recipe below changes in a way its arguments do not show


@dataclass(frozen=True)
class TestImages:
    base: str  # Debian minbase with python3, git, ca-certificates
    marker: str  # the base plus MARKER_PATH holding MARKER_TEXT

    __test__ = False  # not a pytest class


def _key() -> str:
    recipe = "|".join([_RECIPE_VERSION, SUITE, "minbase", ",".join(INCLUDE), MARKER_PATH, MARKER_TEXT])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def _exists(image: str) -> bool:
    proc = subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60, check=False)
    return proc.returncode == 0


def _run(argv: list[str], timeout: float = BUILD_TIMEOUT_S) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} {argv[1]} failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")


def ensure_test_images(lock_dir: Path | None = None) -> TestImages:
    """Both images, built once per content key on this machine; blocking."""
    key = _key()
    images = TestImages(f"localhost/rollout-test-base:{key}", f"localhost/rollout-test-marker:{key}")
    lock_dir = lock_dir or Path(tempfile.gettempdir())
    with open(lock_dir / "rollout-test-images.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _exists(images.base):
            with tempfile.TemporaryDirectory(prefix="rollout-base-") as tmp:
                tar = os.path.join(tmp, "base.tar")
                include = f"--include={','.join(INCLUDE)}"
                _run(["mmdebstrap", "--quiet", "--variant=minbase", include, SUITE, tar])
                _run(["podman", "import", tar, images.base])
        if not _exists(images.marker):
            with tempfile.TemporaryDirectory(prefix="rollout-marker-") as tmp:
                Path(tmp, "Dockerfile").write_text(
                    f"FROM {images.base}\nRUN echo {MARKER_TEXT} > {MARKER_PATH}\n", encoding="utf-8"
                )
                _run(["podman", "build", "--pull=never", "--runtime", "runc", "-q", "-t", images.marker, tmp])
        # The names the Harbor task fixtures use (tests/fixtures/harbor): this recipe's images.
        for image in (images.base, images.marker):
            _run(["podman", "tag", image, image.rpartition(":")[0] + ":latest"])
    return images


def podman_usable() -> str | None:
    """Why the container tests cannot run here, or None when they can."""
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/system-deps installs it as root)"
    if os.geteuid() != 0:
        return "the container tests run podman as root"
    return None


if __name__ == "__main__":
    print(ensure_test_images())
