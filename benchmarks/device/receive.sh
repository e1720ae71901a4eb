#!/usr/bin/env bash
# On the GPU machine, after a call that carried one part: check the parts that have arrived so
# far against SHA256SUMS and say which are still missing. Changes nothing.
cd "$(dirname "$0")/../.."
DIR=${1:-benchmarks/device/wheels}
sums=$(ls "$DIR"/part-*/SHA256SUMS 2>/dev/null | head -1)
[ -n "$sums" ] || { echo "no part under $DIR yet"; exit 1; }
missing=0
while read -r hash name; do
  [ "$name" = bundle.tar ] && continue
  f=$(ls "$DIR"/part-*/"$name" 2>/dev/null | head -1)
  if [ -z "$f" ]; then
    echo "missing: $name"; missing=$((missing + 1))
  elif [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$hash" ]; then
    echo "ok:      $name ($(( $(stat -c %s "$f") >> 20 )) MiB)"
  else
    echo "CORRUPT: $name"; exit 2
  fi
done < "$sums"
echo "$missing part(s) still to carry"
