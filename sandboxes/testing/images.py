"""Container images for the container provider's tests, built here (no image registry is reachable):
a Debian base from Debian's package registry with mmdebstrap, imported into podman, and a second image
with a marker file baked in; and two without any python, as stock ``ubuntu:24.04``, slim and
busybox-style images are: a bare Debian minbase, and an image of nothing but a static busybox. Each is
tagged by a content key of what builds it, so a second CI run on the same machine finds them built; a
lock makes concurrent test processes build each once.

    python -m sandboxes.testing.images      # build (or find) them all, print their tags
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
BUSYBOX = "/bin/busybox"  # Debian's busybox-static: one static binary, its applets as links
MARKER_PATH = "/etc/rollout-image-marker"
MARKER_TEXT = "marker-image"
BUILD_TIMEOUT_S = 600.0
_RECIPE_VERSION = "1"  # bump when the recipe below changes in a way its arguments do not show


@dataclass(frozen=True)
class TestImages:
    base: str  # Debian minbase with python3, git, ca-certificates
    marker: str  # the base plus MARKER_PATH holding MARKER_TEXT
    bare: str  # Debian minbase as it comes: no python3, no git (bash, coreutils, sed, grep)
    busybox: str  # a static busybox and its applets; no C library, no loader, nothing else

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
    images = TestImages(
        f"localhost/rollout-test-base:{key}",
        f"localhost/rollout-test-marker:{key}",
        f"localhost/rollout-test-bare:{key}",
        f"localhost/rollout-test-busybox:{key}",
    )
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
        if not _exists(images.bare):
            with tempfile.TemporaryDirectory(prefix="rollout-bare-") as tmp:
                tar = os.path.join(tmp, "bare.tar")
                _run(["mmdebstrap", "--quiet", "--variant=minbase", SUITE, tar])
                _run(["podman", "import", tar, images.bare])
        if not _exists(images.busybox):
            with tempfile.TemporaryDirectory(prefix="rollout-busybox-") as tmp:
                _busybox_tree(Path(tmp, "tree"))
                _run(["tar", "-C", str(Path(tmp, "tree")), "-cf", os.path.join(tmp, "bb.tar"), "."])
                _run(["podman", "import", os.path.join(tmp, "bb.tar"), images.busybox])
        # The names the Harbor task fixtures use (tests/fixtures/harbor): this recipe's images.
        for image in (images.base, images.marker, images.bare, images.busybox):
            _run(["podman", "tag", image, image.rpartition(":")[0] + ":latest"])
    return images


def _busybox_tree(tree: Path) -> None:
    """A root filesystem of a static busybox, its applets as links in /bin, and a passwd with root."""
    for sub in ("bin", "etc", "tmp", "root"):
        (tree / sub).mkdir(parents=True)
    shutil.copy(BUSYBOX, tree / "bin" / "busybox")
    listed = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, timeout=60, check=True)
    for applet in listed.stdout.split():
        if applet != "busybox":
            (tree / "bin" / applet).symlink_to("busybox")
    (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n", encoding="utf-8")
    (tree / "etc" / "group").write_text("root:x:0:\n", encoding="utf-8")


def podman_usable() -> str | None:
    """Why the container tests cannot run here, or None when they can."""
    for tool in ("podman", "runc", "mmdebstrap", BUSYBOX):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/system-deps installs it as root)"
    if os.geteuid() != 0:
        return "the container tests run podman as root"
    return None


if __name__ == "__main__":
    print(ensure_test_images())
