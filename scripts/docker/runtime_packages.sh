#!/usr/bin/env bash
# The Debian/Ubuntu packages that provide the shared libraries some binaries need, from `ldd`
# and `dpkg -S`; for multi-stage images whose runtime stage installs only those.
#
#   runtime_packages.sh [--allow-unpackaged PREFIX]... BINARY...
#       prints the packages, one a line, sorted
#   runtime_packages.sh --check LIST [--allow-unpackaged PREFIX]... BINARY...
#       fails (exit 1, naming library and package) unless every needed package is in LIST
#       (one package a line, '#' comments), and warns about listed packages nothing needs
#
# A library that ldd cannot find, or that no package owns (outside an allowed PREFIX such as
# /usr/local/cuda in a CUDA build), fails either way. Packages every base image has (libc6,
# libgcc-s1, libstdc++6) are left out.
set -euo pipefail

check=""
allow=()
bins=()
while (($#)); do
  case "$1" in
    --check) check="$2"; shift 2 ;;
    --allow-unpackaged) allow+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) bins+=("$1"); shift ;;
  esac
done
((${#bins[@]})) || { echo "runtime_packages.sh: no binary given" >&2; exit 2; }

declare -A need=()   # package -> one library that needs it
status=0
while read -r lib path; do
  [[ -n "$lib" ]] || continue
  if [[ "$path" == "not" ]]; then
    echo "runtime_packages.sh: $lib: not found by ldd" >&2
    status=1
    continue
  fi
  real=$(readlink -f "$path")
  pkg=""
  for p in "$path" "$real"; do
    pkg=$(dpkg -S "$p" 2>/dev/null | head -n1 | cut -d: -f1) && [[ -n "$pkg" ]] && break
    # usrmerge: /lib and /usr/lib are the same directory, dpkg knows one of the two names.
    alt="${p/#\/usr\/lib\//\/lib\/}"
    [[ "$alt" == "$p" ]] && alt="${p/#\/lib\//\/usr\/lib\/}"
    pkg=$(dpkg -S "$alt" 2>/dev/null | head -n1 | cut -d: -f1) && [[ -n "$pkg" ]] && break
  done
  if [[ -z "$pkg" ]]; then
    ok=0
    for prefix in "${allow[@]}"; do
      [[ "$real" == "$prefix"* || "$path" == "$prefix"* ]] && ok=1
    done
    if ((ok == 0)); then
      echo "runtime_packages.sh: $lib ($real) belongs to no package" >&2
      status=1
    fi
    continue
  fi
  case "$pkg" in libc6|libgcc-s1|libstdc++6) continue ;; esac
  need[$pkg]="$lib"
done < <(ldd "${bins[@]}" | awk '/=>/ {print $1, $3} /not found/ {print $1, "not"}' | sort -u)

if [[ -z "$check" ]]; then
  printf '%s\n' "${!need[@]}" | sort
  exit "$status"
fi
mapfile -t listed < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$check" | grep -v '^$' || true)
declare -A have=()
for p in "${listed[@]}"; do have[$p]=1; done
for p in "${!need[@]}"; do
  if [[ -z "${have[$p]:-}" ]]; then
    echo "runtime_packages.sh: ${need[$p]} comes from package $p, missing from $check" >&2
    status=1
  fi
done
for p in "${listed[@]}"; do
  if [[ -z "${need[$p]:-}" && "$p" != ca-certificates ]]; then
    echo "runtime_packages.sh: note: $check lists $p, which no binary links directly" >&2
  fi
done
((status == 0)) && echo "runtime_packages.sh: every library of ${bins[*]} is provided by $check"
exit "$status"
