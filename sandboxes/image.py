"""The sandbox image: a lean Debian rootfs built offline with debootstrap.

`build_image()` makes `k3rl-sandbox:<version>` without any container registry:

1. debootstrap a `--variant=minbase` Debian into a scratch dir, from the mirror the host's
   apt already uses (read from /etc/apt/sources.list*),
2. `apt-get install --no-install-recommends` the recipe's packages inside it (chroot),
3. add the non-root user `sandbox` (uid 1000) and the work dir `/work`, strip docs/caches,
4. tar it to `<cache>/sandbox-rootfs-<version>.tar` (see `cache_dir`) and `docker import` the tarball.

`<version>` is a hash of the recipe (packages, suite, user, the steps below), so the image
is rebuilt only when the recipe changes. The same rootfs (extracted next to the tarball) is
the root of the bubblewrap backend, so both backends see the same Python and libraries.
`Dockerfile` beside this module builds an equivalent image on machines that reach a registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors

IMAGE_REPOSITORY = "k3rl-sandbox"
SUITE = "bookworm"
SANDBOX_UID = 1000
SANDBOX_USER = "sandbox"
WORK_DIR = "/work"
# Copied into the sandbox's empty /tmp at start and after each reset: matplotlib's font cache,
# so the first plot in a fresh sandbox does not spend seconds rebuilding it.
TMP_SEED_DIR = "/etc/k3rl/tmp-seed"
PACKAGES = (
    "python3",
    "python3-numpy",
    "python3-matplotlib",
    "python3-pil",
    "python3-pytest",
    "python3-munkres",  # satisfies fonttools' "scipy | munkres" so scipy + a C++ toolchain stay out
    "librsvg2-bin",  # rsvg-convert: SVG -> PNG
    "git",
    "procps",
)
# Image config applied by `docker import --change` (same as the Dockerfile's).
IMAGE_CHANGES = (
    f"USER {SANDBOX_UID}:{SANDBOX_UID}",
    f"WORKDIR {WORK_DIR}",
    f"ENV HOME=/home/{SANDBOX_USER}",
    "ENV MPLBACKEND=Agg",
    "ENV PYTHONDONTWRITEBYTECODE=1",
    "ENV LANG=C.UTF-8",
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
)
# Shell run inside the chroot after the packages are in; part of the recipe hash.
CHROOT_FINISH = f"""
set -eu
useradd --uid {SANDBOX_UID} --user-group --create-home --shell /bin/bash {SANDBOX_USER}
mkdir -p {WORK_DIR} && chown {SANDBOX_UID}:{SANDBOX_UID} {WORK_DIR}
mkdir -p /home/{SANDBOX_USER}/.config/matplotlib
echo 'backend: Agg' > /home/{SANDBOX_USER}/.config/matplotlib/matplotlibrc
chown -R {SANDBOX_UID}:{SANDBOX_UID} /home/{SANDBOX_USER}
su {SANDBOX_USER} -c 'HOME=/home/{SANDBOX_USER} MPLBACKEND=Agg python3 -c "import matplotlib.pyplot"'
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/* /usr/share/info/*
find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {{}} +
python3 -m compileall -q -j 0 /usr/lib/python3/dist-packages /usr/lib/python3.11 > /dev/null || true
mkdir -p {TMP_SEED_DIR}
su {SANDBOX_USER} -s /bin/sh -c 'MPLCONFIGDIR=/tmp/k3rl-seed/.matplotlib python3 -c "import matplotlib.pyplot"'
cp -a /tmp/k3rl-seed/. {TMP_SEED_DIR}/ && rm -rf /tmp/k3rl-seed
"""

Log = Callable[[str], None]


def recipe() -> dict:
    """Everything that decides the image's content (the mirror does not: same suite, same packages)."""
    return {
        "suite": SUITE,
        "variant": "minbase",
        "packages": list(PACKAGES),
        "uid": SANDBOX_UID,
        "user": SANDBOX_USER,
        "workdir": WORK_DIR,
        "changes": list(IMAGE_CHANGES),
        "finish": CHROOT_FINISH,
        "seed": TMP_SEED_DIR,
        "format": 1,
    }


def image_version() -> str:
    """12 hex digits of sha256 over the canonical JSON of `recipe()`."""
    blob = json.dumps(recipe(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def image_tag() -> str:
    return f"{IMAGE_REPOSITORY}:{image_version()}"


def cache_dir() -> Path:
    """$K3RL_CACHE_DIR, else /var/cache/k3rl for root (bwrap runs as nobody and must read the rootfs),
    else ~/.cache/k3rl."""
    if os.environ.get("K3RL_CACHE_DIR"):
        return Path(os.environ["K3RL_CACHE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/cache/k3rl")
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "k3rl"


def rootfs_tarball() -> Path:
    return cache_dir() / f"sandbox-rootfs-{image_version()}.tar"


def rootfs_dir() -> Path:
    """Extracted rootfs used as the bubblewrap backend's root (made from the tarball)."""
    return cache_dir() / f"sandbox-rootfs-{image_version()}"


def debian_mirrors(paths: list[Path] | None = None) -> dict[str, str]:
    """Map suite -> mirror URI from the host's apt sources (deb822 `.sources` and one-line `.list`).

    Only `deb` entries whose suite starts with `SUITE` are kept, e.g.
    {"bookworm": "http://deb.debian.org/debian", "bookworm-security": "http://.../debian-security"}.
    """
    if paths is None:
        paths = [Path("/etc/apt/sources.list")]
        d = Path("/etc/apt/sources.list.d")
        if d.is_dir():
            paths += sorted(d.iterdir())
    found: dict[str, str] = {}
    for path in paths:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if "deb" not in fields.get("types", "").split():
                    continue
                for uri in fields.get("uris", "").split():
                    for suite in fields.get("suites", "").split():
                        if suite.startswith(SUITE):
                            found.setdefault(suite, uri)
        else:
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(line) >= 3 and line[0] == "deb" and line[2].startswith(SUITE):
                    found.setdefault(line[2], line[1])
    return found


def _run(cmd: list[str], log: Log, **kw) -> None:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"image build step failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def build_rootfs_tarball(log: Log = print) -> Path:
    """debootstrap + packages + user -> cached tarball. Needs root, debootstrap and a Debian mirror."""
    tarball = rootfs_tarball()
    if tarball.exists():
        log(f"rootfs tarball cached: {tarball}")
        return tarball
    if os.geteuid() != 0:
        raise PermissionError("building the sandbox rootfs needs root (debootstrap + chroot); run as root")
    if shutil.which("debootstrap") is None:
        raise FileNotFoundError("debootstrap is not installed: apt-get install -y debootstrap")
    mirrors = debian_mirrors()
    if SUITE not in mirrors:
        raise RuntimeError(
            f"no 'deb' source for suite {SUITE!r} in /etc/apt/sources.list*: add the Debian mirror "
            "apt should use (the image is built from it)"
        )
    tarball.parent.mkdir(parents=True, exist_ok=True)
    tarball.parent.chmod(0o755)
    with tempfile.TemporaryDirectory(prefix="k3rl-rootfs-", dir=tarball.parent) as scratch:
        root = Path(scratch) / "rootfs"
        _run(["debootstrap", "--variant=minbase", SUITE, str(root), mirrors[SUITE]], log)
        sources = "".join(f"deb {uri} {suite} main\n" for suite, uri in sorted(mirrors.items()))
        (root / "etc/apt/sources.list").write_text(sources)
        (root / "etc/apt/apt.conf.d/90k3rl").write_text(
            'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n'
        )
        (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
        (root / "usr/sbin/policy-rc.d").chmod(0o755)
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
        _run(["chroot", str(root), "apt-get", "update"], log, env=env)
        _run(
            ["chroot", str(root), "apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
            log,
            env=env,
        )
        _run(["chroot", str(root), "sh", "-c", CHROOT_FINISH], log, env=env)
        (root / "usr/sbin/policy-rc.d").unlink()
        partial = tarball.with_suffix(".tar.partial")
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], log)
        partial.rename(tarball)
    log(f"rootfs tarball: {tarball} ({tarball.stat().st_size / 1e6:.0f} MB)")
    return tarball


def extract_rootfs(log: Log = print) -> Path:
    """Unpack the cached tarball for the bubblewrap backend (once per version)."""
    target = rootfs_dir()
    if (target / "usr/bin/python3").exists():
        return target
    tarball = build_rootfs_tarball(log)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _run(["tar", "--numeric-owner", "-C", str(partial), "-xf", str(tarball)], log)
    partial.rename(target)
    log(f"rootfs extracted for bubblewrap: {target}")
    return target


def image_exists(client, tag: str | None = None) -> bool:
    """Whether the daemon holds `tag` (default: the k3rl-sandbox image of this version)."""
    try:
        client.images.get(tag or image_tag())
        return True
    except docker.errors.ImageNotFound:
        return False


def build_image(client=None, force: bool = False, log: Log = print, with_rootfs_dir: bool = True) -> str:
    """Build `k3rl-sandbox:<version>` if missing (or `force`); return the tag."""
    client = client or docker.from_env()
    tag = image_tag()
    if not force and image_exists(client):
        log(f"image up to date: {tag}")
    else:
        tarball = build_rootfs_tarball(log)
        log(f"docker import {tarball} {tag}")
        client.api.import_image_from_file(
            str(tarball), repository=IMAGE_REPOSITORY, tag=image_version(), changes=list(IMAGE_CHANGES)
        )
        log(f"image built: {tag}")
    if with_rootfs_dir and rootfs_tarball().exists():
        extract_rootfs(log)
    prune_old_versions(log, client)
    return tag


def prune_old_versions(log: Log = print, client=None) -> None:
    """Delete cached rootfs tarballs/dirs and images of other recipe versions (images still used stay)."""
    keep = image_version()
    if client is not None:
        for img in client.images.list(name=IMAGE_REPOSITORY):
            for tag in img.tags:
                if tag.startswith(IMAGE_REPOSITORY + ":") and tag != image_tag():
                    try:
                        client.images.remove(tag)
                        log(f"removed stale image {tag}")
                    except docker.errors.APIError as exc:
                        log(f"kept stale image {tag}: {exc.explanation or exc}")
    root = cache_dir()
    if not root.is_dir():
        return
    for entry in root.glob("sandbox-rootfs-*"):
        if keep not in entry.name:
            log(f"removing stale cache entry {entry}")
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def rootfs_tar_members_ok(tarball: Path) -> bool:
    """Cheap sanity check used by `doctor`: the tarball holds python3 and the sandbox user."""
    try:
        with tarfile.open(tarball) as tar:
            names = set(tar.getnames())
    except (OSError, tarfile.TarError):
        return False
    return "./usr/bin/python3" in names and f"./home/{SANDBOX_USER}" in names
