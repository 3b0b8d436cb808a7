#!/usr/bin/env bash
# Every CUDA path of pairclean end to end on a toy world (a smoke test for a GPU machine; CI has none):
# estimator training, scoring in fp32 / bf16 / fp16 (sims compared), detection, training with
# plain / --weights / --online in bf16 and plain in fp16, retrieval evaluation, --decode gpu.
#     bash benchmarks/cuda_paths.sh [WORKDIR]        (needs `pip install -e .` and a CUDA device)
set -u
W=${1:-$(mktemp -d)}
pc() { echo "+ pairclean $*"; python -m pairclean "$@" 2>&1 | grep -v "^\s*$" | tail -25; local rc=${PIPESTATUS[0]}; echo "  rc=$rc"; [ "$rc" = 0 ] || failed=1; }
failed=0
pc synth toy-world --out "$W/est-world" --pairs 8000 --seed 1
pc synth toy-world --out "$W/world" --pairs 4000 --seed 0
pc synth toy-world --out "$W/val" --pairs 1000 --seed 3
pc synth train-estimator --out "$W/est" --world "$W/est-world" --device cuda --workers 8
pc corrupt "$W/world/manifest.yaml" --out "$W/noisy" --ratio 0.5 --seed 0
for prec in fp32 bf16 fp16; do
  pc score "$W/noisy/manifest.yaml" --out "$W/s-$prec.parquet" --model pairclean-toy --pretrained "$W/est/estimator.pt" \
     --device cuda --precision $prec --workers 8
done
pc evaluate detection "$W/s-bf16.parquet" --truth "$W/noisy/truth/truth.parquet"
pc query "$W/s-fp32.parquet" "SELECT max(abs(a.sim - b.sim)) AS fp32_vs_bf16 FROM scores a JOIN '$W/s-bf16.parquet' b USING (shard, \"index\")"
common=(--val "$W/val/manifest.yaml" --model pairclean-tiny --pretrained none --batch-size 128 --lr 1e-3 --warmup-steps 20 --device cuda --workers 8)
pc train "$W/noisy/manifest.yaml" --out "$W/run-plain" --epochs 3 --precision bf16 "${common[@]}"
pc train "$W/noisy/manifest.yaml" --out "$W/run-weights" --epochs 3 --precision bf16 --weights "$W/s-bf16.parquet" "${common[@]}"
pc train "$W/noisy/manifest.yaml" --out "$W/run-online" --epochs 3 --precision bf16 --online \
   --estimator-model pairclean-toy --estimator-pretrained "$W/est/estimator.pt" "${common[@]}"
pc train "$W/noisy/manifest.yaml" --out "$W/run-fp16" --epochs 1 --precision fp16 "${common[@]}"
pc evaluate retrieval "$W/val/manifest.yaml" --model "$W/run-weights" --device cuda
pc synth coco-mini --src "$(dirname "$0")/../tests/data/coco-mini" --out "$W/coco"
pc score "$W/coco" --out "$W/coco-gpu.parquet" --model ViT-B-32 --pretrained none --device cuda --precision bf16 --decode gpu --beta-mode shuffled
echo "work directory: $W"; [ "$failed" = 0 ] && echo "all CUDA paths ran" || { echo "some command failed"; exit 1; }
