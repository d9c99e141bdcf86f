# shellcheck shell=bash disable=SC2153  # NAME, REPORT, LOGS, DEADLINE_S: the caller's
# Shared by deploy/gpu-check.sh and deploy/gpu-check-offline.sh (sourced, never run):
# a wall-clock budget for the whole check, steps that each get what is left of it,
# and the JSON report. The caller sets NAME, REPORT, LOGS and DEADLINE_S first.
#
#   step NAME LIMIT_S CMD...   run CMD, a command or a shell function (output in
#                              $LOGS/NAME.log), for at most LIMIT_S seconds and never
#                              past the budget; records ok/failed (124: timed out)
#   skip NAME REASON           record a step that did not run, and why
#   fact KEY VALUE             a top-level string fact for the report (gpu, torch, ...)
#   finish EXIT                write $REPORT and exit EXIT

T0=$(date +%s)
STEPS_TSV=$(mktemp)
FACTS_TSV=$(mktemp)
# shellcheck disable=SC2034  # read by the caller
failed=0

remaining() { echo $((DEADLINE_S - ($(date +%s) - T0))); }

step() {
  local name=$1 limit=$2
  shift 2
  local log=$LOGS/$name.log left t0 rc secs
  left=$(remaining)
  if [ "$left" -lt 15 ]; then
    skip "$name" "the check's ${DEADLINE_S} s budget is spent"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  echo "== $name (at most ${limit}s)"
  # CMD may be a shell function: run it in a subshell of its own process group (job
  # control on), so the limit stops it and everything it started
  set -m
  ("$@") >"$log" 2>&1 &
  local pid=$! timed_out=0
  set +m
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(($(date +%s) - t0)) -ge "$limit" ]; then
      timed_out=1
      kill -TERM -- "-$pid" 2>/dev/null
      sleep 5
      kill -KILL -- "-$pid" 2>/dev/null
      break
    fi
    sleep 1
  done
  wait "$pid"
  rc=$?
  [ $timed_out = 1 ] && rc=124
  secs=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    echo "   ok in ${secs}s"
    printf '%s\tok\t%s\t%s\t%s\t\n' "$name" "$rc" "$secs" "$log" >>"$STEPS_TSV"
  else
    local why="exit $rc"
    [ $rc -eq 124 ] && why="timed out after ${limit}s"
    echo "   FAILED ($why) in ${secs}s; last lines of $log:"
    tail -n 15 "$log"
    # shellcheck disable=SC2034  # read by the caller
    failed=1
    printf '%s\tfailed\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$log" "$why" >>"$STEPS_TSV"
  fi
  return $rc
}

skip() {
  echo "== $1: skipped ($2)"
  printf '%s\tskipped\t\t0\t\t%s\n' "$1" "$2" >>"$STEPS_TSV"
}

fact() { printf '%s\t%s\n' "$1" "$2" >>"$FACTS_TSV"; }

finish() {
  local code=$1
  mkdir -p "$(dirname "$REPORT")"
  python3 - "$NAME" "$code" "$(($(date +%s) - T0))" "$DEADLINE_S" "$STEPS_TSV" "$FACTS_TSV" \
    >"$REPORT" <<'PY' || printf '{"check": "%s", "exit": %s}\n' "$NAME" "$code" >"$REPORT"
import json, sys
name, code, wall, budget, steps_tsv, facts_tsv = sys.argv[1:7]
steps = []
for line in open(steps_tsv).read().splitlines():
    step, status, rc, secs, log, reason = (line.split("\t") + [""] * 6)[:6]
    entry = {"step": step, "status": status, "seconds": int(secs or 0)}
    if rc:
        entry["exit"] = int(rc)
    if log:
        entry["log"] = log
    if reason:
        entry["reason"] = reason
    steps.append(entry)
facts = dict(line.split("\t", 1) for line in open(facts_tsv).read().splitlines() if line)
report = {"check": name, "exit": int(code), "wall_seconds": int(wall),
          "budget_seconds": int(budget), **facts, "steps": steps}
json.dump(report, sys.stdout, indent=1)
print()
PY
  rm -f "$STEPS_TSV" "$FACTS_TSV"
  echo "report: $REPORT (exit $code)"
  exit "$code"
}

# no_gpu: record why and stop with exit 2 (the documented "no GPU" code)
no_gpu() {
  fact gpu ""
  fact reason "$1"
  echo "$NAME: $1; nothing to do" >&2
  finish 2
}

gpu_or_exit() {
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    no_gpu "no NVIDIA GPU visible (nvidia-smi not found)"
  fi
  local gpu
  if ! gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1) || [ -z "$gpu" ]; then
    no_gpu "no NVIDIA GPU visible (nvidia-smi lists none)"
  fi
  fact gpu "$gpu"
  echo "GPU: $gpu"
}
