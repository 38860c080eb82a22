#!/usr/bin/env bash
# The one command to run on a machine with a GPU and no network (the project and
# its wheels installed): every GPU check and benchmark, each step's output into
# one folder, and a markdown summary of them.
#
#   bench/gpu_suite.sh [--out DIR]      # a GPU: the full suite
#   bench/gpu_suite.sh --smoke          # any machine (CPU): every step in minimal form
#
# Steps (each runs even when an earlier one failed; its status, time and key
# figure go into DIR/summary.md, its whole output into DIR/<step>.log):
#   env      nvidia-smi (if present), python, torch, CUDA, triton, transformers versions
#   pytest   the CUDA tests: python -m pytest -m gpu tests
#   kernels  bench/kernels.py (grouped GEMM, permute/unpermute vs torch)
#   e2e      bench/e2e.py --preset h100_1gpu (ours vs HF transformers, real vs mock data)
#   train    30 bf16 steps of the single-GPU proxy (+experiment=h100_1gpu, data.shards=sample)
#            with train.compile=true; its figures via bench/sweep_table.py
# --smoke: the same steps on the CPU with tiny presets: the tests (skipped without
# CUDA), kernels under TRITON_INTERPRET=1 --smoke, e2e --preset tiny --smoke, and 3
# steps of the embedded tiny model without compile (too slow to be a smoke test).
# Plain bash and python, no network; nothing here depends on the torch or triton
# version (torch 2.11 + triton 3.6 on the GPU machine, 2.13 on CPU).
# Exit status: 0 when every step passed, else 1 (the summary says which failed).
set -u

SMOKE=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument $1 (use --smoke, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_suite_out/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
SUMMARY="$OUT/summary.md"
ROWS="$OUT/.rows"
: > "$ROWS"
FAILED=0

# step NAME KEY_COMMAND -- COMMAND...: runs COMMAND into NAME.log; KEY_COMMAND (a shell snippet reading
# the log, "$LOG") gives the key figure.  pytest's "no tests selected" (exit 5) counts as passed.
step() {
  local name="$1" key="$2"; shift 3
  local log="$OUT/$name.log" t0 t1 rc status
  echo "== $name: $*" | tee "$log"
  t0=$(date +%s.%N)
  "$@" >> "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  if [ "$rc" -eq 0 ]; then status="ok"
  elif [ "$name" = "pytest" ] && [ "$rc" -eq 5 ]; then status="ok (no gpu tests collected)"
  else status="FAILED (exit $rc)"; FAILED=1
  fi
  local figure
  figure="$(LOG="$log" bash -c "$key" 2>/dev/null | tr '\n|' ' /' | cut -c1-300)"
  printf '| %s | %s | %s | %s |\n' "$name" "$status" "$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}")" "$figure" >> "$ROWS"
  echo "== $name: $status (log: $log)"
}

env_report() {
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not found (no NVIDIA driver)"; fi
  "$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA available {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if torch.cuda.is_available() else ""))
for name in ("triton", "transformers", "hydra", "webdataset"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except Exception as err:  # noqa: BLE001 - a missing optional package is reported, not fatal
        print(f"{name}: not importable ({type(err).__name__})")
EOF
}

if [ "$SMOKE" -eq 1 ]; then
  export TRITON_INTERPRET=1
  KERNELS=("$PY" bench/kernels.py --smoke)
  E2E=("$PY" bench/e2e.py --preset tiny --smoke data.num_workers=0 data.pack.seq_len=256 data.pack.max_patches=64
       data.image.max_pixels=16384)
  TRAIN=("$PY" train.py train.steps=3 data.num_workers=0 train.checkpoint_at_end=false train.tensorboard=false
         train.require_loss_decrease=false "train.run_dir=$OUT/train_run")
  WARMUP=1
else
  KERNELS=("$PY" bench/kernels.py)
  E2E=("$PY" bench/e2e.py --preset h100_1gpu)
  # the sample set's tokenizer ids, which the random-init proxy takes (docs/training.md, "The command line")
  SAMPLE_IDS=(model.image_token_id=1020 model.video_token_id=1021 model.vision_start_token_id=1018
              model.vision_end_token_id=1019)
  TRAIN=("$PY" train.py +experiment=h100_1gpu data.shards=sample "${SAMPLE_IDS[@]}" train.steps=30 train.precision=bf16
         train.compile=true train.log_every=1 train.checkpoint_at_end=false train.tensorboard=false
         "train.run_dir=$OUT/train_run")
  WARMUP=5
fi

step env 'grep -E "^python |^triton |^transformers " "$LOG"' -- env_report
step pytest 'grep -E "(passed|failed|skipped|deselected|error)" "$LOG" | tail -1' -- "$PY" -m pytest -m gpu -q -o addopts= tests
step kernels 'echo "$(grep -c "^|" "$LOG") table lines"' -- "${KERNELS[@]}"
step e2e 'grep -E "^ours/HF:" "$LOG"; awk -F"|" "/^\| (image_free|random_pixels) /{print \$2 \"vs real\" \$9}" "$LOG"' -- "${E2E[@]}"
step train 'grep -E "^done:" "$LOG" | cut -d";" -f1' -- "${TRAIN[@]}"
step train_table 'tail -1 "$LOG"' -- "$PY" bench/sweep_table.py "$OUT/train_run" --warmup "$WARMUP"

{
  echo "# GPU suite$([ "$SMOKE" -eq 1 ] && echo ' (--smoke, CPU)')"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), folder $OUT"
  echo
  echo "| step | status | seconds | key figure |"
  echo "|---|---|---:|---|"
  cat "$ROWS"
  for name in e2e kernels train_table; do
    echo
    echo "## $name"
    echo
    grep -E '^(\||ours/HF:|device:|LM loss)' "$OUT/$name.log" || echo "(no table: see $name.log)"
  done
} > "$SUMMARY"
rm -f "$ROWS"
echo "summary: $SUMMARY"
exit "$FAILED"
