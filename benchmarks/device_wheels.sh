#!/usr/bin/env bash
# Wheels the RL job needs on the GPU device image (Python 3.12; it has torch, triton, numpy,
# pyarrow, rich, typer, requests, aiohttp, grpcio, protobuf, ... but not Ray, MLflow, Gymnasium
# or pydantic), written to .whl_rl/ (git-ignored) and carried with the device `run`:
#
#   bash benchmarks/device_wheels.sh            # here, once (needs the package registry)
#   # on the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl_rl/*.whl
#   tar xJf .whl_rl/ray-slim.tar.xz -C /tmp/site && export PYTHONPATH=$PWD:/tmp/site
#
# Ray's own wheel (79 MB) is over the device's 64 MiB carry limit, so it travels trimmed: the
# Java jars, the dashboard's web client and the libraries the job never imports (rllib, serve,
# data, llm, tune, train) are left out, and the rest is xz-compressed (about 20 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl_rl
mkdir -p "$out"
grep -qx '/.whl_rl/' .git/info/exclude 2>/dev/null || echo '/.whl_rl/' >> .git/info/exclude
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_34_x86_64 -d "$1" "${@:2}"
}
# what `import k3rl.job` and an MLflow SQLite run import beyond the device image (read off
# importlib.metadata.packages_distributions() after a local run), at the versions of .venv
pkgs=(Farama-Notifications Mako SQLAlchemy alembic cachetools cffi cryptography databricks-sdk docker fastapi
      gitdb gitpython google-api-core google-auth googleapis-common-protos gymnasium importlib_metadata
      jsonschema jsonschema-specifications mlflow-skinny opentelemetry-api opentelemetry-exporter-prometheus
      opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions pyasn1 pyasn1-modules
      python-dotenv referencing rpds-py smmap sqlparse starlette uvicorn wcwidth)
# pydantic and its helpers travel in .whl/, beside the kernel benchmarks' wheels (fla-core)
mkdir -p .whl
grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
for p in pydantic pydantic_core annotated_types typing_inspection; do
  v=$(.venv/bin/pip show "$p" 2>/dev/null | awk '/^Version/{print $2}')
  get .whl "$p==$v"
done
for p in "${pkgs[@]}"; do
  v=$(.venv/bin/pip show "$p" 2>/dev/null | awk '/^Version/{print $2}')
  [ -n "$v" ] || { echo "not in .venv: $p (run make setup first)" >&2; exit 1; }
  get "$out" "$p==$v"
done
ray_v=$(.venv/bin/pip show ray | awk '/^Version/{print $2}')
out_abs=$(realpath "$out")
tmp=$(mktemp -d)
get "$tmp" "ray==$ray_v"
mkdir "$tmp/x"
(cd "$tmp/x" && unzip -q ../ray-*.whl \
  && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/serve ray/data ray/llm ray/tune ray/train \
  && tar cf - . | xz -9 -T0 > "$out_abs/ray-slim.tar.xz")
rm -rf "$tmp"
du -sh "$out"
