#!/usr/bin/env bash
# Install MLX's CUDA backend and the wheels this package needs on a machine with no network,
# from the parts prepare.sh made (DIR/part-N/bundle.tar.NN + SHA256SUMS), carried there.
#
#   benchmarks/device/install.sh [DIR]      # DIR: benchmarks/device/wheels
#
# Every piece and the re-joined bundle are checked against SHA256SUMS first. The wheels go into
# the interpreter's own environment (PYTHON, default python3), where libmlx.so finds the CUDA
# libraries of the nvidia-* packages beside it (its rpath is ../../nvidia/*/lib); where that
# environment is read-only they go to /tmp/mlx-site with a link to those libraries, and
# /tmp/mlx-voicechat-env.sh sets PYTHONPATH (run_gpu.sh sources it).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-benchmarks/device/wheels}
PY=${PYTHON:-python3}
ENV_FILE=/tmp/mlx-voicechat-env.sh
: > "$ENV_FILE"

rc=0
benchmarks/device/receive.sh "$DIR" > "$ENV_FILE.parts" || rc=$?
grep -v '^ok:' "$ENV_FILE.parts" || true
[ "$rc" -ne 2 ] || { echo "install: a carried part is corrupt; carry it again" >&2; exit 2; }
sums=$(ls "$DIR"/part-*/SHA256SUMS 2>/dev/null | head -1 || true)
[ -n "$sums" ] || { echo "install: no part under $DIR; see benchmarks/device/README.md" >&2; exit 3; }
pieces=()
while read -r hash name; do
  [ "$name" = bundle.tar ] && continue
  f=$(ls "$DIR"/part-*/"$name" 2>/dev/null | head -1 || true)
  [ -n "$f" ] || { echo "install: $name has not been carried here; see benchmarks/device/README.md" >&2; exit 3; }
  pieces+=("$f")
done < "$sums"
tmp=$(mktemp -d)
cat "${pieces[@]}" > "$tmp/bundle.tar"
(cd "$tmp" && grep ' bundle.tar$' "$OLDPWD/$sums" | sha256sum -c --quiet) \
  || { echo "install: the re-joined bundle does not match SHA256SUMS" >&2; exit 4; }
mkdir "$tmp/wheels"
tar xf "$tmp/bundle.tar" -C "$tmp/wheels"
rm "$tmp/bundle.tar"
echo "install: $(ls "$tmp"/wheels/*.whl | wc -l) wheels, bundle sha256 verified"

args=(-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check)
if ! "$PY" "${args[@]}" "$tmp"/wheels/*.whl; then
  echo "install: $PY's environment refused the wheels; installing to /tmp/mlx-site" >&2
  "$PY" "${args[@]}" --upgrade --target /tmp/mlx-site "$tmp"/wheels/*.whl
  nvidia=$("$PY" -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))")/nvidia
  ln -sfn "$nvidia" /tmp/mlx-site/nvidia
  echo "export PYTHONPATH=/tmp/mlx-site\${PYTHONPATH:+:\$PYTHONPATH}" > "$ENV_FILE"
fi
rm -rf "$tmp"
# shellcheck disable=SC1090
. "$ENV_FILE"
"$PY" - <<'PY'
import mlx.core as mx
assert mx.is_available(mx.gpu), "MLX was installed but sees no GPU (is this an NVIDIA machine?)"
with mx.stream(mx.gpu):
    x = mx.random.normal((512, 512))
    ok = mx.allclose(x @ mx.eye(512), x).item()
info = mx.device_info()
print(f"install: mlx {mx.__version__} on {info.get('device_name', 'the GPU')}: a matmul "
      f"{'agrees' if ok else 'DISAGREES'}")
PY
