#!/usr/bin/env bash
# The one command to run on a machine with a GPU and no network (the project and
# its wheels installed): every GPU check and benchmark, in priority order, each
# step's output into one folder as soon as it ends, and a markdown summary.
#
#   bench/gpu_suite.sh [--out DIR] [--work DIR] [--budget SECONDS]   # a GPU: the full suite
#   bench/gpu_suite.sh --smoke                                      # any machine (CPU): every step in minimal form
#
# Steps, most important first (each runs even when an earlier one failed; its status,
# time and key figure go into DIR/summary.md, rewritten after every step, its whole
# output into DIR/<step>.log):
#   env            nvidia-smi, versions, and the device's two ceilings: a device-to-device
#                  copy (GB/s, read + write) and an 8192^3 bf16 matmul (TFLOP/s) on random data
#   pytest         the CUDA tests, Triton compiled: TRITON_INTERPRET=0 python -m pytest -m gpu tests
#                  (240 s: on a fresh machine the Triton compiles take ~2 min of it; warm, 42 s)
#   kernels        bench/kernels.py at the Qwen3-30B-A3B expert shape (grouped GEMM, FP8, permute)
#   plan           bench/plans.py device --recipe h100_1gpu: the planner's peak beside
#                  torch.cuda.max_memory_allocated of the same step
#   train_eager    20 bf16 steps of the single-GPU proxy (+experiment=h100_1gpu) on the sample
#                  set, then its figures (bench/sweep_table.py: tokens/s, TFLOP/s, MFU, memory, data wait)
#                  and where the step's time goes: train.profile_components (CUDA events around each
#                  part, one sync per step) and the last step's torch.profiler trace summarised by
#                  bench/trace_top.py (device busy/idle, time by kind of kernel, by part, top kernels;
#                  the medians skip nothing for it: one step in 15)
#   train_compiled the same with train.compile=true
#   e2e            bench/e2e.py --preset h100_1gpu: ours vs HF transformers, real vs mock data
# --budget SECONDS: the whole suite's wall-clock limit.  Each step runs under its own time
# limit, cut to what the budget has left (a step left under 20 s is skipped, and says so), so a
# cut run still holds every step that finished.  Without --budget only the steps' own limits apply
# (GPU; --smoke has none).  --work DIR: the training runs' folders and scratch (default
# DIR/work), apart from the logs, so DIR holds only summary.md and one log per step.
# --steps A,B: only the named steps (the others are listed as not run): a second, shorter call
# after fixes.
# --smoke: the same steps on the CPU with tiny presets: the tests (skipped without
# CUDA), kernels under TRITON_INTERPRET=1 --smoke, the plan of the embedded default, 3
# steps of the embedded tiny model (train_compiled is skipped: compiling is a GPU
# measurement, too slow for a smoke run), e2e --preset tiny --smoke.
# Plain bash and python, no network; nothing here depends on the torch or triton
# version (torch 2.11 + triton 3.6 on the GPU machine, 2.13 on CPU).
# Exit status: 0 when every step passed, else 1 (the summary says which failed).
set -u

SMOKE=0
OUT=""
WORK=""
BUDGET=""
STEPS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --work) WORK="${2:?--work needs a folder}"; shift ;;
    --work=*) WORK="${1#--work=}" ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --budget=*) BUDGET="${1#--budget=}" ;;
    --steps) STEPS="${2:?--steps needs names}"; shift ;;
    --steps=*) STEPS="${1#--steps=}" ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument $1 (use --smoke, --out DIR, --work DIR, --budget SECONDS, --steps A,B)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET" in
  *[!0-9]*) echo "gpu_suite.sh: --budget takes whole seconds, got $BUDGET" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_suite_out/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${WORK:-$OUT/work}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step cut at its limit keeps everything it printed
PY="${PYTHON:-$(command -v python || command -v python3)}"
SUMMARY="$OUT/summary.md"
ROWS="$WORK/summary_rows"
: > "$ROWS"
FAILED=0
START=$(date +%s)
MIN_STEP=20  # seconds: a step the budget leaves less is skipped
LIMIT=""

write_summary() {
  {
    echo "# GPU suite$([ "$SMOKE" -eq 1 ] && echo ' (--smoke, CPU)')"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), folder $OUT$([ -n "$BUDGET" ] && echo ", budget $BUDGET s")"
    echo
    echo "| step | status | seconds | key figure |"
    echo "|---|---|---:|---|"
    cat "$ROWS"
    for name in env kernels plan train_eager train_compiled e2e; do
      [ -f "$OUT/$name.log" ] || continue
      echo
      echo "## $name"
      echo
      grep -E '^(\||ours/HF:|device:|LM loss|ceiling:)' "$OUT/$name.log" || echo "(no table: see $name.log)"
    done
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

# limited CMD...: CMD under the current step's time limit ($LIMIT seconds; none when empty).
limited() {
  if [ -n "$LIMIT" ]; then timeout -k 15 "$LIMIT" "$@"; else "$@"; fi
}

# step NAME LIMIT KEY_COMMAND -- COMMAND...: runs COMMAND into NAME.log under min(LIMIT, what the
# budget has left) seconds (LIMIT "-": none); KEY_COMMAND (a shell snippet reading the log, "$LOG")
# gives the key figure.  pytest's "no tests selected" (exit 5) counts as passed; exit 124/137 is a
# cut at the limit.  COMMAND may be a function of this script, which runs its programs `limited`.
step() {
  local name="$1" own="$2" key="$3"; shift 4
  local log="$OUT/$name.log" t0 t1 rc status left
  LIMIT=""
  if [ -n "$STEPS" ] && [[ ",$STEPS," != *",$name,"* ]]; then
    printf '| %s | not run (--steps %s) | 0 | |\n' "$name" "$STEPS" >> "$ROWS"
    echo "== $name: not run (--steps $STEPS)"
    return
  fi
  if [ "$own" != "-" ] && [ "$SMOKE" -eq 0 ]; then LIMIT="$own"; fi
  if [ -n "$BUDGET" ]; then
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 0 ]; then left=0; fi  # an overrun budget has nothing left, not a debt
    if [ "$left" -lt "$MIN_STEP" ]; then
      printf '| %s | skipped (budget: %s s left) | 0 | |\n' "$name" "$left" >> "$ROWS"
      echo "== $name: skipped, the budget has $left s left"
      FAILED=1
      write_summary
      return
    fi
    if [ -z "$LIMIT" ] || [ "$left" -lt "$LIMIT" ]; then LIMIT="$left"; fi
  fi
  echo "== $name (limit ${LIMIT:-none} s): $*" | tee "$log"
  t0=$(date +%s.%N)
  if [ "$(type -t "$1")" = "function" ]; then "$@" >> "$log" 2>&1; else limited "$@" >> "$log" 2>&1; fi
  rc=$?
  t1=$(date +%s.%N)
  if [ "$rc" -eq 0 ]; then status="ok"
  elif [ "$name" = "pytest" ] && [ "$rc" -eq 5 ]; then status="ok (no gpu tests collected)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="CUT at its $LIMIT s limit"; FAILED=1
  else status="FAILED (exit $rc)"; FAILED=1
  fi
  local figure
  figure="$(LOG="$log" bash -c "$key" 2>/dev/null | tr '\n|' ' /' | cut -c1-300)"
  printf '| %s | %s | %s | %s |\n' "$name" "$status" "$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")" "$figure" >> "$ROWS"
  echo "== $name: $status (log: $log)"
  write_summary
}

env_report() {
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not found (no NVIDIA driver)"; fi
  limited "$PY" bench/gpu_env.py
}

# train_run NAME OVERRIDES...: a training run into $WORK/NAME, a summary of its trace if it made one,
# then its one-row table (last: the step's key figure is the log's last table line)
train_run() {
  local name="$1" rc trace
  shift
  limited "${TRAIN[@]}" "$@" "train.run_dir=$WORK/$name"
  rc=$?
  for trace in "$WORK/$name"/profile/*.json; do
    [ -f "$trace" ] && limited "$PY" bench/trace_top.py "$trace"
  done
  "$PY" bench/sweep_table.py "$WORK/$name" --warmup "$WARMUP"
  return "$rc"
}

if [ "$SMOKE" -eq 1 ]; then
  export TRITON_INTERPRET=1
  KERNELS=("$PY" bench/kernels.py --smoke)
  PLAN=("$PY" bench/plans.py device train.global_batch_size=2)
  E2E=("$PY" bench/e2e.py --preset tiny --smoke data.num_workers=0 data.pack.seq_len=256 data.pack.max_patches=64
       data.image.max_pixels=16384)
  TRAIN=("$PY" train.py train.steps=3 data.num_workers=0 train.checkpoint_at_end=false train.tensorboard=false
         train.require_loss_decrease=false)
  WARMUP=1
  LAST=3
else
  export TRITON_INTERPRET=0  # the kernels compiled for the GPU (tests/conftest.py defaults it to 1)
  KERNELS=("$PY" bench/kernels.py --shapes 30b --tokens 16384 --iters 10)
  # the sample set's tokenizer ids, which the random-init proxy takes (docs/training.md, "The command line")
  SAMPLE_IDS=(model.image_token_id=1020 model.video_token_id=1021 model.vision_start_token_id=1018
              model.vision_end_token_id=1019)
  PLAN=("$PY" bench/plans.py device --recipe h100_1gpu "${SAMPLE_IDS[@]}")
  E2E=("$PY" bench/e2e.py --preset h100_1gpu --warmup 2 --iters 5)
  TRAIN=("$PY" train.py +experiment=h100_1gpu data.shards=sample "${SAMPLE_IDS[@]}" train.steps=20
         train.precision=bf16 train.log_every=1 train.checkpoint_at_end=false train.tensorboard=false
         train.progress=false)
  WARMUP=5
  LAST=20
fi

TRAIN_KEY='grep -E "^done:" "$LOG" | cut -d";" -f1; grep -E "^\| " "$LOG" | tail -1'
step env 60 'grep -E "^python |^triton |^transformers |^ceiling: " "$LOG"' -- env_report
step pytest 240 'grep -E "(passed|failed|skipped|deselected|error)" "$LOG" | tail -1' -- \
  "$PY" -m pytest -m gpu -q -o addopts= -p no:cacheprovider --basetemp "$WORK/pytest" tests
step kernels 150 'echo "$(grep -c "^|" "$LOG") table lines"' -- "${KERNELS[@]}"
step plan 120 'grep -A2 "^| job " "$LOG" | tail -1' -- "${PLAN[@]}"
step train_eager 150 "$TRAIN_KEY" -- train_run train_eager train.compile=false \
  train.profile_components=true "train.profile_steps=[$LAST,$LAST]"
if [ "$SMOKE" -eq 1 ]; then
  printf '| %s | %s | 0 | |\n' train_compiled "skipped (--smoke: compiling is measured on the GPU)" >> "$ROWS"
else
  step train_compiled 240 "$TRAIN_KEY" -- train_run train_compiled train.compile=true
fi
step e2e 300 'grep -E "^ours/HF:" "$LOG"; awk -F"|" "/^\| (image_free|random_pixels) /{print \$2 \"vs real\" \$9}" "$LOG"' -- "${E2E[@]}"
write_summary
echo "summary: $SUMMARY"
exit "$FAILED"
