#!/usr/bin/env bash
# The GPU figures still owed, each a section that writes its logs and JSON under OUT_DIR, so one
# background session on one GPU takes them in order:
#
#   setsid tools/gpu_figures.sh OUT_DIR fp8 startup smollm2-compile > OUT_DIR.log 2>&1 &
#
#   fp8              the drafter step and the prefill at the paper shapes, bf16 then FP8 (train.fp8,
#                    target.fp8), in one process each; then a one-GPU training run at the reference
#                    shapes with both switches; then the GPU tests of FP8 (BENCHMARKS.md, issue "FP8")
#   startup          the cold launch under compile.enabled=auto and =true (an empty compile cache each),
#                    the same launch warm, the embedded default as a whole, a checkpoint's stall
#   smollm2-compile  train=smollm2 at SmolLM2's shape (random weights, synthetic data), 200 steps eager
#                    then compiled: is compile.enabled=auto's eager choice right for a launch-bound model?
#   humaneval-speed  HumanEval's wall clock at batch 1 and 16 for the recipe's export (needs runs/smollm2)
#
# Every section prints "[seconds] section: what" lines to OUT_DIR/timeline.txt; PYTHON picks the
# interpreter (default python3). NCCL_NVLS_ENABLE=0 is kept.
set -uo pipefail
OUT=${1:?usage: tools/gpu_figures.sh OUT_DIR SECTION...}
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"
t0=$(date +%s)
mark() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/timeline.txt"; }
PAPER=(target=qwen3_8b train=paper)
REFERENCE=(train.max_len=768 train.num_anchors=256 'train.buckets=[768]')
LAUNCH=(target=qwen3_8b target.path=random data=synthetic train=paper train.max_steps=3 train.batch_size=4
        eval.enabled=false)
SMOL=(target=smollm2_135m target.path=random data=synthetic data.mean_length=600 train=smollm2 train.max_steps=200
      eval.enabled=false checkpoint.every=0)

fp8() {
  for variant in bf16 fp8; do
    extra=(); [ "$variant" = fp8 ] && extra=(train.fp8=true target.fp8=true)
    "$PY" -m dflash.bench "${PAPER[@]}" "${extra[@]}" --modes reduce-overhead --accumulation 16 --steps 3 \
        --out "$OUT/bench_$variant.json" > "$OUT/bench_$variant.log" 2>&1
    mark "fp8: bench $variant rc=$?"
  done
  "$PY" -m dflash.bench --train-ranks 1 --steps 10 target=qwen3_8b target.path=random data=synthetic train=paper \
      "${REFERENCE[@]}" train.fp8=true target.fp8=true --out "$OUT/train_fp8.json" > "$OUT/train_fp8.log" 2>&1
  mark "fp8: training run rc=$?"
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu -k fp8 > "$OUT/tests_fp8.log" 2>&1
  mark "fp8: GPU tests rc=$? ($(tail -1 "$OUT/tests_fp8.log"))"
}

startup() {
  for compile in auto true; do
    rm -rf "$OUT/cache_$compile"
    /usr/bin/time -f "%e" -o "$OUT/cold_$compile.s" "$PY" -m dflash.train "${LAUNCH[@]}" compile.enabled=$compile \
        compile.cache_dir="$OUT/cache_$compile" output_dir="$OUT/cold_$compile" > "$OUT/cold_$compile.log" 2>&1
    mark "startup: cold, compile.enabled=$compile: $(cat "$OUT/cold_$compile.s") s"
  done
  /usr/bin/time -f "%e" -o "$OUT/warm.s" "$PY" -m dflash.train "${LAUNCH[@]}" compile.enabled=true \
      compile.cache_dir="$OUT/cache_true" output_dir="$OUT/warm" > "$OUT/warm.log" 2>&1
  mark "startup: warm, compile.enabled=true: $(cat "$OUT/warm.s") s"
  /usr/bin/time -f "%e" -o "$OUT/default.s" "$PY" -m dflash.train output_dir="$OUT/default" > "$OUT/default.log" 2>&1
  mark "startup: the embedded default: $(cat "$OUT/default.s") s"
  "$PY" -m dflash.bench "${PAPER[@]}" --modes reduce-overhead --checkpoint "$OUT/ckpt" --out "$OUT/bench_ckpt.json" \
      > "$OUT/bench_ckpt.log" 2>&1
  mark "startup: checkpoint stall rc=$?"
  rm -rf "$OUT/ckpt" "$OUT"/cache_*
}

smollm2-compile() {
  for compile in false true; do
    /usr/bin/time -f "%e" -o "$OUT/smol_$compile.s" "$PY" -m dflash.train "${SMOL[@]}" compile.enabled=$compile \
        output_dir="$OUT/smol_$compile" > "$OUT/smol_$compile.log" 2>&1
    mark "smollm2-compile: compile.enabled=$compile: $(cat "$OUT/smol_$compile.s") s, last line: $(grep samples/s \
        "$OUT/smol_$compile.log" | tail -1 | grep -o '[0-9.]* samples/s')"
  done
}

humaneval-speed() {
  "$PY" -m dflash.eval --target outputs/targets/smollm2-135m-instruct --drafter runs/smollm2/run/export \
      --sets humaneval --max-new-tokens 512 --speed 32 --out "$OUT/eval_humaneval_speed.json" > "$OUT/he_speed.log" 2>&1
  mark "humaneval-speed rc=$?"
}

for section in "$@"; do
  case "$section" in
    fp8|startup|smollm2-compile|humaneval-speed) mark "$section: start"; "$section" ;;
    *) echo "unknown section '$section' (fp8, startup, smollm2-compile, humaneval-speed)" >&2; exit 2 ;;
  esac
done
mark done
