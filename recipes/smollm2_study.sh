#!/usr/bin/env bash
# The recipe study on SmolLM2-135M-Instruct: the prompts and regenerated replies of
# recipes/smollm2.sh, one seed and one budget (train=smollm2), trained four ways, each scored on
# HumanEval (z-lab's format, greedy) and on the held-out prompts, with tau against samples seen
# from evaluations while training; recipes/study.py writes study.md and study.png.
#
#   recipes/smollm2.sh runs/smollm2          # first: the target, the prompts, the replies (and its own run)
#   recipes/smollm2_study.sh [WORK_DIR]      # default runs/smollm2: study/<variant>/{run,eval_*.json}, study/study.md and study.png
#
# The variants (VARIANTS selects and orders them; default all four):
#   ce        cross-entropy alone: train=smollm2 as it is
#   kl        with the KL term against the target's top-32 logits (loss.kl_topk=32 loss.kl_weight=1.0)
#   dflash2   DFlash2 at block 8 (drafter.variant=dflash2 drafter.block_size=8)
#   sliding   four sliding-window layers of 256 tokens and one full (drafter.layer_types, drafter.sliding_window)
# Environment, besides the recipe's TARGET_DIR, HUMANEVAL, MAX_NEW, EPOCHS, SAMPLES, TRAIN_OVERRIDES, EVAL_ARGS:
#   EVAL_EVERY    steps between evaluations while training (default 100); EVAL_PROMPTS held-out prompts each (32)
#   DRY_RUN=1     print each variant's plan and stop
set -euo pipefail
WORK=${1:-runs/smollm2}
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TARGET_DIR=${TARGET_DIR:-outputs/targets/smollm2-135m-instruct}
MAX_NEW=${MAX_NEW:-512}
EPOCHS=${EPOCHS:-6}
read -r -a VARIANT_LIST <<< "${VARIANTS:-ce kl dflash2 sliding}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_OVERRIDES:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_ARGS:-}"
declare -A OVERRIDES=(
  [ce]=""
  [kl]="loss.kl_topk=32 loss.kl_weight=1.0"
  [dflash2]="drafter.variant=dflash2 drafter.block_size=8"
  [sliding]="drafter.layer_types=[sliding_attention,sliding_attention,sliding_attention,sliding_attention,full_attention] drafter.sliding_window=256"
)
for v in "${VARIANT_LIST[@]}"; do
  [ -n "${OVERRIDES[$v]+set}" ] || { echo "unknown variant '$v' (known: ${!OVERRIDES[*]})" >&2; exit 2; }
done
for f in regen_greedy.jsonl regen_sampled.jsonl prompts/heldout.jsonl; do
  [ -f "$WORK/$f" ] || { echo "$WORK/$f is missing: run recipes/smollm2.sh $WORK first" >&2; exit 2; }
done
start=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
HE=("humaneval${HUMANEVAL:+=$HUMANEVAL}")
COMMON=(target=smollm2_135m target.path="$TARGET_DIR" data=jsonl
        "data.path=[$WORK/regen_greedy.jsonl,$WORK/regen_sampled.jsonl]" data.eval_path="$WORK/prompts/heldout.jsonl"
        train=smollm2 train.epochs="$EPOCHS" eval.every="${EVAL_EVERY:-100}" eval.max_prompts="${EVAL_PROMPTS:-32}"
        eval.max_new_tokens="$MAX_NEW")

for v in "${VARIANT_LIST[@]}"; do
  out="$WORK/study/$v"
  read -r -a extra <<< "${OVERRIDES[$v]}"
  args=("${COMMON[@]}" "${extra[@]}" "${TRAIN_EXTRA[@]}" output_dir="$out/run")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    step "$v: the plan"
    "$PY" -m dflash.train "${args[@]}" dry_run=true
    continue
  fi
  step "$v: train"
  mkdir -p "$out"
  "$PY" -m dflash.train "${args[@]}"
  step "$v: score the export on HumanEval and on the held-out prompts"
  "$PY" -m dflash.eval --target "$TARGET_DIR" --drafter "$out/run/export" --sets "${HE[@]}" \
      --max-new-tokens "$MAX_NEW" ${SAMPLES:+--max-samples "$SAMPLES"} --out "$out/eval_humaneval.json" "${EVAL_EXTRA[@]}"
  "$PY" -m dflash.eval --target "$TARGET_DIR" --drafter "$out/run/export" \
      --data "heldout=$WORK/prompts/heldout.jsonl" --max-new-tokens "$MAX_NEW" --max-prompts 1000 \
      --out "$out/eval_heldout.json" "${EVAL_EXTRA[@]}"
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
"$PY" -m recipes.study "$WORK/study" --variants "${VARIANT_LIST[@]}" | tee "$WORK/study/study.md"
step "done: $WORK/study/study.md"
