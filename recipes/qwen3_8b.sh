#!/usr/bin/env bash
# Qwen3-8B from prompts to a table of acceptance against the released drafter:
# regenerate the replies with the target, train with the paper's configuration on the
# GPUs present, score the export and the released drafter on the public sets as z-lab's
# harness builds them, and write one table (set, tau ours, tau released, lossless).
#
#   recipes/qwen3_8b.sh MODEL_DIR PROMPTS RELEASED_DRAFTER_DIR [WORK_DIR]
#
#   MODEL_DIR             local Qwen/Qwen3-8B (huggingface-cli download Qwen/Qwen3-8B --local-dir ...)
#   PROMPTS               chat prompts in any format training reads (JSONL, JSON, Parquet, saved dataset)
#   RELEASED_DRAFTER_DIR  local z-lab/Qwen3-8B-DFlash-b16 (or any drafter for this target in the z-lab layout)
#   WORK_DIR              default runs/qwen3_8b: plan.txt, regen.jsonl, run/, eval_*.json, acceptance.md
#
# Environment:
#   DRY_RUN=1        print the plan, hours and GPU-hours, and stop
#   SERVER=URL       regenerate through a vLLM or SGLang OpenAI-compatible endpoint serving the target
#   NGPU             GPUs to use (default: all visible; 0 or 1 runs in one process)
#   TARGET           target preset (default qwen3_8b); EPOCHS (default 6, train=paper's)
#   BENCH            sets to score (default gsm8k,math500,humaneval,mbpp,mt-bench)
#   TRAIN_OVERRIDES, REGEN_ARGS, EVAL_ARGS   extra arguments of each step (space-separated)
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,21p' "$0"; exit 2; }
MODEL=$1 PROMPTS=$2 RELEASED=$3 WORK=${4:-runs/qwen3_8b}
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TARGET=${TARGET:-qwen3_8b}
EPOCHS=${EPOCHS:-6}
BENCH=${BENCH:-gsm8k,math500,humaneval,mbpp,mt-bench}
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
read -r -a TRAIN_EXTRA <<< "${TRAIN_OVERRIDES:-}"
read -r -a REGEN_EXTRA <<< "${REGEN_ARGS:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_ARGS:-}"
mkdir -p "$WORK"
TARGET_ARGS=(target="$TARGET" target.path="$MODEL" data=jsonl)
TRAIN_ARGS=("${TARGET_ARGS[@]}" data.path="$WORK/regen.jsonl" train=paper train.epochs="$EPOCHS" output_dir="$WORK/run" "${TRAIN_EXTRA[@]}")

echo "== plan ($NGPU GPU(s))"
"$PY" -m dflash.train "${TARGET_ARGS[@]}" data.path="$PROMPTS" train=paper train.epochs="$EPOCHS" "${TRAIN_EXTRA[@]}" \
    dry_run=true estimate.nproc="$(( NGPU > 1 ? NGPU : 1 ))" | tee "$WORK/plan.txt"
"$PY" -m recipes.hours --data "$PROMPTS" --epochs "$EPOCHS" --gpus "$NGPU" < "$WORK/plan.txt" | tee -a "$WORK/plan.txt"
[ "${DRY_RUN:-0}" = 1 ] && exit 0

echo "== regenerate the replies with the target"
REGEN=(-m dflash.regenerate "${TARGET_ARGS[@]}" data.path="$PROMPTS" --out "$WORK/regen.jsonl" "${REGEN_EXTRA[@]}")
if [ -n "${SERVER:-}" ]; then
  "$PY" "${REGEN[@]}" --server "$SERVER"
elif [ "$NGPU" -gt 1 ]; then
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" "${REGEN[@]}"
else
  "$PY" "${REGEN[@]}"
fi

echo "== train"
if [ "$NGPU" -gt 1 ]; then
  PYTHON="$PY" NPROC="$NGPU" ./launch.sh "${TRAIN_ARGS[@]}"
else
  "$PY" -m dflash.train "${TRAIN_ARGS[@]}"
fi

echo "== score the export and the released drafter on $BENCH"
for who in ours released; do
  drafter=$([ "$who" = ours ] && echo "$WORK/run/export" || echo "$RELEASED")
  "$PY" -m dflash.eval --target "$MODEL" --drafter "$drafter" --sets "$BENCH" --out "$WORK/eval_$who.json" \
      "${EVAL_EXTRA[@]}"
done
"$PY" -m dflash.eval --compare "$WORK/eval_ours.json" "$WORK/eval_released.json" --out "$WORK/acceptance.md"
echo "table: $WORK/acceptance.md"
