#!/usr/bin/env bash
# Before/after runs of one command on two versions of the package, interleaved (A B A B ...), e.g. on the device tool's
# H200 where per-call host times drift +-20% between runs of one code (docs/bench_duty_eager_h200_session24.txt).
#   bash scripts/ab_trees.sh prepare REV [DIR=.abtree]   here: the package of commit REV into DIR (git-ignored;
#                                                         carry DIR to the device)
#   bash scripts/ab_trees.sh run N DIR OUTDIR -- CMD...   N rounds: CMD inside DIR (before), then CMD in the repo root
#                                                         (after); output in OUTDIR/{before,after}<r>.txt
# Why run the old tree from INSIDE its folder: `python -m` puts the working directory first on sys.path, ahead of
# PYTHONPATH, so PYTHONPATH=DIR python -m ... still imports the checkout's verl_quads (session 24 measured one code
# twice that way). Each output starts with the file verl_quads was imported from.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    rev=${2:?REV}; dir=${3:-.abtree}
    git check-ignore -q "$dir/x" || { echo "$dir is not git-ignored: add /$dir/ to .git/info/exclude" >&2; exit 2; }
    rm -rf "$dir" && mkdir -p "$dir" && git archive "$rev" verl_quads | tar -x -C "$dir"
    echo "$dir: verl_quads of $(git rev-parse --short "$rev")" ;;
  run)
    n=${2:?N}; dir=${3:?DIR}; out=${4:?OUTDIR}; shift 4
    [ "${1:-}" = "--" ] && shift
    [ -d "$dir/verl_quads" ] || { echo "no $dir/verl_quads (run prepare first)" >&2; exit 2; }
    mkdir -p "$out"; out=$(realpath "$out")
    where='import verl_quads, sys; print("verl_quads from", verl_quads.__file__, flush=True)'
    for r in $(seq 1 "$n"); do
      (cd "$dir" && python3 -c "$where" && "$@") > "$out/before$r.txt" 2>&1 || echo "before run $r: exit $?" >&2
      (python3 -c "$where" && "$@") > "$out/after$r.txt" 2>&1 || echo "after run $r: exit $?" >&2
    done ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
