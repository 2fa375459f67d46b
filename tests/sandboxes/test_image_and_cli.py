"""Image recipe, mirror discovery, path rules, backend choice and the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from k3rl.sandboxes import PathEscapeError, choose_backend, image
from k3rl.sandboxes.paths import resolve_in_workdir

from .conftest import docker_skip_reason


def test_mirrors_are_read_from_both_apt_source_formats(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n"
    )
    one_line = tmp_path / "extra.list"
    one_line.write_text(
        "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://other.example/debian bookworm main\n"
        "deb https://packages.example/apt cloud-sdk main\n"
    )
    found = image.debian_mirrors([deb822, one_line])
    assert found == {
        "bookworm": "http://mirror.example/debian",
        "bookworm-updates": "http://mirror.example/debian",
        "bookworm-security": "http://sec.example/debian-security",
    }
    assert image.debian_mirrors([one_line]) == {"bookworm": "http://other.example/debian"}


def test_image_version_is_a_hash_of_the_recipe(monkeypatch):
    version = image.image_version()
    assert re.fullmatch(r"[0-9a-f]{12}", version) and image.image_tag() == f"k3rl-sandbox:{version}"
    assert image.image_version() == version  # stable
    monkeypatch.setattr(image, "PACKAGES", (*image.PACKAGES, "python3-scipy"))
    assert image.image_version() != version  # a recipe change means a new image


def test_dockerfile_installs_the_same_packages_as_the_offline_build():
    text = (Path(image.__file__).with_name("Dockerfile")).read_text()
    install = text.split("--no-install-recommends", 1)[1].split("&&", 1)[0]
    assert sorted(install.replace("\\", " ").split()) == sorted(image.PACKAGES)
    assert f"USER {image.SANDBOX_UID}:{image.SANDBOX_UID}" in text and f"WORKDIR {image.WORK_DIR}" in text


@pytest.mark.parametrize(
    "path,expected",
    [("a.txt", "/work/a.txt"), ("d/../b", "/work/b"), ("/work/x/y", "/work/x/y"), ("./c//d", "/work/c/d")],
)
def test_paths_inside_the_work_dir_are_normalised(path, expected):
    assert resolve_in_workdir(path) == expected


@pytest.mark.parametrize("path", ["..", "../x", "/etc/passwd", "/work/../etc", "/workx", "", "a\0b", "/"])
def test_paths_leaving_the_work_dir_are_refused_with_the_reason(path):
    with pytest.raises(
        PathEscapeError, match="outside the sandbox work dir|invalid sandbox path|work dir itself"
    ):
        resolve_in_workdir(path)


@pytest.mark.docker
def test_auto_picks_docker_when_a_daemon_answers():
    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    assert choose_backend("auto") == "docker"
    assert choose_backend("bwrap") == "bwrap"
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        choose_backend("lxc")


@pytest.mark.docker
def test_cli_doctor_build_and_gc():
    from typer.testing import CliRunner

    from k3rl.sandboxes.cli import app

    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    runner = CliRunner()
    doctor = runner.invoke(app, ["doctor"])
    assert doctor.exit_code == 0, doctor.output
    assert "docker daemon" in doctor.output and "backend 'auto' -> docker" in doctor.output
    build = runner.invoke(app, ["build"])  # recipe unchanged: a no-op that says so
    assert build.exit_code == 0 and f"image up to date: {image.image_tag()}" in build.output
    gc = runner.invoke(app, ["gc", "--job", "no-such-job-k3rl"])
    assert gc.exit_code == 0 and "0 leftover(s) removed" in gc.output


@pytest.mark.docker
def test_missing_image_or_rootfs_says_how_to_build_it(tmp_path):
    from k3rl.sandboxes import BackendUnavailableError, open_sandbox

    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(BackendUnavailableError, match="k3rl-sandbox:not-built-anywhere is not on this host: pull or build"):
        open_sandbox("docker", image="k3rl-sandbox:not-built-anywhere")
    # "auto" never swaps a Docker image the job named for bubblewrap
    with pytest.raises(BackendUnavailableError, match="Docker image k3rl-sandbox:not-built-anywhere cannot run here"):
        open_sandbox("auto", image="k3rl-sandbox:not-built-anywhere")
    with pytest.raises(BackendUnavailableError, match="k3rl sandbox build"):
        open_sandbox("bwrap", rootfs=tmp_path)  # an empty dir is no rootfs


@pytest.mark.docker
def test_a_pool_runs_its_sandboxes_in_the_image_it_is_given():
    """The job's `sandbox.image` reaches the containers (here: another tag of the sandbox image)."""
    import asyncio
    import os

    from k3rl.sandboxes import SandboxPool, image_tag
    from k3rl.sandboxes.docker_backend import docker_client

    reason = docker_skip_reason()
    if reason:
        pytest.skip(reason)
    client = docker_client()
    custom = f"k3rl-test-image:{os.getpid()}"
    client.images.get(image_tag()).tag(custom)

    async def main():
        async with SandboxPool("auto", max_size=1, min_idle=0, image=custom, job=f"image-{os.getpid()}") as pool:
            async with pool.sandbox(timeout=120) as sb:
                assert (await sb.aexec("echo ok")).stdout == "ok\n"
                return client.api.inspect_container(sb.id)["Config"]["Image"]

    try:
        assert asyncio.run(main()) == custom
    finally:
        client.images.remove(custom)
