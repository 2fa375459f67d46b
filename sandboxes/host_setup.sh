#!/usr/bin/env bash
# Host setup for k3rl sandboxes (Debian, as root). Idempotent: run it from `make setup` / CI
# on a fresh machine or again on a ready one.
#   1. installs docker.io, bubblewrap and debootstrap when missing (apt),
#   2. starts `dockerd --bridge=none` when no Docker daemon answers (sandboxes need no network),
#      and waits until it does,
#   3. builds the sandbox image k3rl-sandbox:<recipe hash> offline (debootstrap from the mirror
#      apt already uses + docker import); a no-op when the recipe is unchanged,
#   4. installs a headless Chromium (Debian's chromium-headless-shell) for the browser tests when
#      no Chromium is there; optional: without it those tests are skipped.
# Environment: K3RL_PYTHON (python with k3rl installed; default .venv/bin/python, else python3),
#              K3RL_DOCKERD_LOG (default /var/log/k3rl-dockerd.log).
set -euo pipefail

say() { echo "[k3rl host_setup] $*"; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${K3RL_PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$repo_root/.venv/bin/python" ]; then python="$repo_root/.venv/bin/python"; else python="python3"; fi
fi

if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    # Not root on Debian: change nothing, say what is there (tests skip what cannot run, with the reason).
    say "not root on a Debian host: installing, starting dockerd and building the image need root;"
    say "run 'sudo $0' for the full setup. Current state:"
    "$python" -c "from k3rl.sandboxes import cli_doctor; cli_doctor()" || true
    exit 0
fi
dockerd_log="${K3RL_DOCKERD_LOG:-/var/log/k3rl-dockerd.log}"

# 1. packages ------------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    say "packages present: docker.io bubblewrap debootstrap"
fi

# 2. Docker daemon ---------------------------------------------------------------------------
if docker info >/dev/null 2>&1; then
    say "docker daemon answers"
else
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        say "starting docker through systemd"
        systemctl start docker || true
    fi
    if ! docker info >/dev/null 2>&1; then
        say "starting dockerd --bridge=none in the background (log: $dockerd_log)"
        setsid nohup dockerd --bridge=none >>"$dockerd_log" 2>&1 < /dev/null &
    fi
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        say "docker daemon did not come up within 60 s; last lines of $dockerd_log:" >&2
        tail -n 20 "$dockerd_log" >&2 || true
        exit 1
    fi
    say "docker daemon answers"
fi

# 3. sandbox image ---------------------------------------------------------------------------
say "building the sandbox image with $python (no-op when up to date)"
"$python" -c "from k3rl.sandboxes import cli_build; cli_build()"

# 4. headless Chromium for tests/test_browser.py ---------------------------------------------------
if command -v chromium >/dev/null 2>&1 || command -v chromium-headless-shell >/dev/null 2>&1; then
    say "chromium present"
else
    say "installing chromium-headless-shell (browser tests; optional)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium-headless-shell; }; then
        say "could not install chromium-headless-shell: the browser tests will be skipped"
    fi
fi
say "done"
