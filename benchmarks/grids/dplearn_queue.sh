#!/bin/bash
# Pre-registered extension (fixed 2026-12-02 05:21 UTC, before any of these runs had
# finished): the recipe (configs/minilm-tweets-dp-top1.toml) at seeds 3-9 for ε 8, 3, 1, so
# that recipe vs probe is decided once, on 10 paired seeds per ε (the probe's seeds 3-9:
# benchmarks.grids.runner dplearn --only probe-b500; rows in planned-seeds.jsonl).
# Usage: benchmarks/grids/dplearn_queue.sh RUNS_DIR [SEEDS]   (run two copies at once for two slots; SEEDS, e.g.
# "7 8 9", limits the seeds; default: 3 to 9). A job whose row is already in
# planned-seeds.jsonl is skipped.
# (All 42 were in on 2026-12-02 15:12 UTC and their rows moved into results.jsonl, where
# the queue now looks for them.)
# Resumable and safe in several slots: a job is claimed with mkdir (RUNS_DIR/locks); a
# finished job (manifest.json) is skipped; a started one resumes from its last round.
# `touch RUNS_DIR/cos-r1qv-eps<E>-s<S>/STOP` stops a run cleanly after its current round.
set -u
runs=$(realpath "${1:?usage: queue.sh RUNS_DIR}")
cd "$(dirname "$0")/../.." || exit 1
rows=benchmarks/results/claims/dplearn/results.jsonl
mkdir -p "$runs/locks"
seeds=${2:-3 4 5 6 7 8 9}
for s in $seeds; do for e in 8 3 1; do
  d=$runs/cos-r1qv-eps$e-s$s
  [ -f "$d/manifest.json" ] && continue
  # collected in an earlier session (runs folders do not survive sessions)
  grep -F "\"group\": \"lora1-cos-r1qv-b500-s20-r10/eps$e\"" "$rows" | grep -qF "\"seed\": $s," && continue
  if ! mkdir "$runs/locks/eps$e-s$s" 2>/dev/null; then
    # claimed by a live slot? (a stale lock after a reboot is taken over)
    pid=$(cat "$runs/locks/eps$e-s$s/pid" 2>/dev/null)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then continue; fi
  fi
  echo $$ > "$runs/locks/eps$e-s$s/pid"
  if ls "$d"/checkpoint/meta-*.json > /dev/null 2>&1; then
    OMP_NUM_THREADS=1 .venv/bin/fedlora train --resume "$d" >> "$d.log" 2>&1
  else
    rm -rf "$d"
    OMP_NUM_THREADS=1 .venv/bin/fedlora train --config configs/minilm-tweets-dp-top1.toml \
      --epsilon $e --seed $s --eval-nonmembers --out "$d" > "$d.log" 2>&1
  fi
done; done
