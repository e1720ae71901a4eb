#!/usr/bin/env bash
# Prepare, on a machine with the package index, the wheels that MLX's CUDA backend and this
# package need on the GPU machine (Python 3.12, manylinux x86_64, no network there), as one
# tar bundle split into parts that each fit one device call beside the working tree.
#
#   benchmarks/device/prepare.sh            # writes benchmarks/device/wheels/part-N/ (ignored)
#   PART_MIB=20 benchmarks/device/prepare.sh
#
# A device call carries at most 64 MiB: the working tree (tracked and untracked files that git
# does not ignore) plus the carried paths. So each part is 64 MiB minus the tree, minus a margin,
# unless PART_MIB says otherwise. Each part folder holds its piece and SHA256SUMS (the bundle's
# hash and every piece's); the re-join is checked here before anything is carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=benchmarks/device/wheels
PY=${PIP_PYTHON:-python3}
WHEELS=(
  mlx==0.32.4 mlx-cuda-13==0.32.4        # MLX and its CUDA 13 backend (libmlx.so, ~86 MiB)
  mlx-lm==0.32.2 mlx-audio==0.6.2        # imported by mlx_voicechat (pure Python)
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 soxr==1.1.0   # audio I/O and resampling
)
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
         manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done

rm -rf "$OUT"
mkdir -p "$OUT/dl"
echo "downloading ${#WHEELS[@]} wheels for CPython 3.12 manylinux x86_64 ..."
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$OUT/dl" "${WHEELS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
n=$(ls "$OUT"/dl/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; }

# What travels with every call besides the carried paths.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
       | awk '{s += $1} END {print s + 0}')
margin=$((2 << 20))
if [ -n "${PART_MIB:-}" ]; then
  part=$((PART_MIB << 20))
else
  part=$(((64 << 20) - tree - margin))
fi
[ "$part" -gt $((4 << 20)) ] || { echo "the working tree ($((tree >> 20)) MiB) leaves no room" >&2; exit 1; }

(cd "$OUT/dl" && tar cf ../bundle.tar --sort=name *.whl)
size=$(stat -c %s "$OUT/bundle.tar")
split -b "$part" -d -a 2 "$OUT/bundle.tar" "$OUT/bundle.tar."
pieces=("$OUT"/bundle.tar.[0-9][0-9])
(cd "$OUT" && sha256sum bundle.tar bundle.tar.[0-9][0-9]) > "$OUT/SHA256SUMS"
for piece in "${pieces[@]}"; do
  k=$((10#${piece##*.} + 1))
  mkdir -p "$OUT/part-$k"
  mv "$piece" "$OUT/part-$k/"
  cp "$OUT/SHA256SUMS" "$OUT/part-$k/"
done

# The re-join, as install.sh does it there, must give the same bundle.
cat "$OUT"/part-*/bundle.tar.[0-9][0-9] | sha256sum | cut -d' ' -f1 > "$OUT/rejoined.sha256"
want=$(grep ' bundle.tar$' "$OUT/SHA256SUMS" | cut -d' ' -f1)
[ "$(cat "$OUT/rejoined.sha256")" = "$want" ] || { echo "re-join differs from the bundle" >&2; exit 1; }
rm "$OUT/bundle.tar" "$OUT/rejoined.sha256"

count=${#pieces[@]}
echo "bundle: $n wheels, $((size >> 20)) MiB, sha256 $want"
echo "working tree $((tree >> 20)) MiB -> $count parts of at most $((part >> 20)) MiB (re-join checked)"
echo
echo "Device calls, one after the other (the machine stays warm 30 s after each):"
for k in $(seq 1 "$count"); do
  if [ "$k" -lt "$count" ]; then
    echo "  $k. carry [\"$OUT/part-$k\"]  command: benchmarks/device/receive.sh"
  else
    echo "  $k. carry [\"$OUT/part-$k\"]  command: benchmarks/device/run_gpu.sh   (timeout_s 600)"
  fi
done
