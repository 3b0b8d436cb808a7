#!/usr/bin/env bash
# The toy estimator recipe at several (training world seed, learning rate) settings, each scored on
# the demo's evaluation set (world seed 0, 2,000 pairs, 50% shuffle noise, noise seed 0): ROC-AUC,
# GMM and oracle balanced accuracy, and the final training loss (docs/lab.md, "Known weakness").
#     bash benchmarks/estimator_lr_sweep.sh WORKDIR 1:3e-3 2:3e-3 3:3e-3 1:1e-3 2:1e-3 3:1e-3
# About 2 minutes per setting on 2 CPU cores.
set -euo pipefail
W=$1; shift
mkdir -p "$W"
if [ ! -f "$W/noisy/truth/truth.parquet" ]; then
  python -m pairclean synth toy-world --out "$W/world" --pairs 2000 --seed 0 --overwrite > /dev/null
  python -m pairclean corrupt "$W/world" --out "$W/noisy" --ratio 0.5 --seed 0 --overwrite > /dev/null
fi
for setting in "$@"; do
  seed=${setting%%:*}; lr=${setting##*:}; run="$W/world$seed-lr$lr"
  python -m pairclean synth train-estimator --out "$run" --world-seed "$seed" --lr "$lr" --overwrite > "$run.log" 2>&1
  python -m pairclean score "$W/noisy" --out "$run/scores.parquet" --model pairclean-toy \
      --pretrained "$run/estimator.pt" --overwrite > /dev/null 2>&1
  python -m pairclean evaluate detection "$run/scores.parquet" --truth "$W/noisy/truth/truth.parquet" \
      --json "$run/detection.json" > /dev/null 2>&1
  python - "$run" "$seed" "$lr" <<'PY'
import json, sys
run, seed, lr = sys.argv[1:]
det = json.load(open(f"{run}/detection.json"))
est = json.load(open(f"{run}/estimator.json"))
rules = det["rules"]
print(f"world seed {seed}  lr {lr}:  ROC-AUC {det['roc_auc']:.4f}  GMM {rules['gmm']['balanced_accuracy']:.2f} "
      f"vs oracle {rules['oracle']['balanced_accuracy']:.2f}  beta rule {rules['beta']['balanced_accuracy']:.2f}  "
      f"final train loss {est['epochs'][-1]['train_loss']:.2f}  train {est['train_seconds']:.0f} s", flush=True)
PY
done
