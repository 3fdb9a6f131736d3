#!/usr/bin/env bash
# Carry Inductor's and Triton's compile caches from one device call to the next.
#
# Every device call starts on a bare machine, and compiling the CLIP-style model costs ~50 s per
# compiled variant and batch size (bench_step.py at batch 8 and 32 spends ~7 of its ~9 minutes
# compiling). With the caches of an earlier call the same graphs compile in 5-15 s.
#
#   at the end of a call:    bash benchmarks/device_cache.sh save     (writes $OUT/inductor_cache.tar.xz.partNN)
#   here, between calls:     mkdir -p .device_cache && cp <files_at>/inductor_cache.tar.xz.part* .device_cache/
#   at the start of a call:  bash benchmarks/device_cache.sh load     (run with carry: [".device_cache"])
#
# Parts are 15 MB (the device tool returns files of at most 16 MiB, 8 files, 64 MiB in all): a
# cache too large to come back whole is not saved (a partial archive cannot be unpacked).
set -euo pipefail
cache_dir="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}"
here="$(cd "$(dirname "$0")/.." && pwd)/.device_cache"
case "${1:-}" in
  save)
    out="${OUT:?OUT is not set: run this on the device machine}"
    [ -d "$cache_dir" ] || { echo "no cache at $cache_dir"; exit 0; }
    # xz on every core: single-threaded, saving a ~300 MB cache took ~280 s of a 600 s call
    XZ_OPT="-T0" tar -C "$(dirname "$cache_dir")" -cJf /tmp/inductor_cache.tar.xz "$(basename "$cache_dir")"
    size=$(stat -c %s /tmp/inductor_cache.tar.xz)
    if [ "$size" -gt $((4 * 15 * 1000 * 1000)) ]; then  # carry takes 64 MiB (67.1 MB) with the tree
      echo "cache archive is $((size / 1000000)) MB: too large to bring back, not saved"; exit 0
    fi
    split -b 15000000 -d /tmp/inductor_cache.tar.xz "$out/inductor_cache.tar.xz.part"
    echo "saved $((size / 1000000)) MB of compile cache in $(ls "$out"/inductor_cache.tar.xz.part* | wc -l) part(s)"
    ;;
  load)
    if ls "$here"/inductor_cache.tar.xz.part* >/dev/null 2>&1; then
      mkdir -p "$cache_dir"
      cat "$here"/inductor_cache.tar.xz.part* | XZ_OPT="-T0" tar -C "$cache_dir" --strip-components=1 -xJf -
      echo "loaded the compile cache into $cache_dir"
    else
      echo "no carried compile cache in $here: compiling from scratch"
    fi
    ;;
  *) echo "usage: $0 save|load" >&2; exit 2 ;;
esac
