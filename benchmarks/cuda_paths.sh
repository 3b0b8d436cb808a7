#!/usr/bin/env bash
# Every CUDA path of pairclean end to end on a toy world (a smoke test for a GPU machine; CI has none):
# estimator training, scoring in fp32 / bf16 / fp16 (sims compared), detection, training with
# plain / --weights / --online in bf16 and plain in fp16, retrieval evaluation, --decode gpu (and half its
# JPEGs in the workers: --cpu-decode-share; against PIL's decode: --decode exact), --decode gpu-resize and fast against PIL's resize,
# training with --decode gpu and gpu-resize.
#     bash benchmarks/cuda_paths.sh [WORKDIR]        (needs `pip install -e .` and a CUDA device)
# A dry run of every command on a CPU (fp16 left out: CUDA only), so the device's minutes are not
# spent on a broken line:  DEVICE=cpu PAIRS=400 WORKERS=2 bash benchmarks/cuda_paths.sh /tmp/cp
set -u
W=${1:-$(mktemp -d)}
mkdir -p "$W"
DEVICE=${DEVICE:-cuda}
PAIRS=${PAIRS:-4000}  # the scored world; the estimator's is twice that, the validation set a quarter
WORKERS=${WORKERS:-8}
PRECISIONS="fp32 bf16"; [ "$DEVICE" = cpu ] || PRECISIONS="$PRECISIONS fp16"
pc() { echo "+ pairclean $*"; python -m pairclean "$@" 2>&1 | grep -v "^\s*$" | tail -25; local rc=${PIPESTATUS[0]}; echo "  rc=$rc"; [ "$rc" = 0 ] || failed=1; }
failed=0
# the device decoders on real JPEGs first (the pixels every GPU run depends on; session 14's call ran out
# of time before reaching them), then the toy world's every CUDA path
pc synth coco-mini --src "$(dirname "$0")/../tests/data/coco-mini" --out "$W/coco"
pc score "$W/coco" --out "$W/coco-gpu.parquet" --model ViT-B-32 --pretrained none --device "$DEVICE" --precision bf16 --decode gpu --beta-mode shuffled
# half the JPEGs decoded by the workers (PIL) and resized on the device with the rest; how far that moves the sims
pc score "$W/coco" --out "$W/coco-share.parquet" --model ViT-B-32 --pretrained none --device "$DEVICE" --precision bf16 --decode gpu \
   --cpu-decode-share 0.5 --beta-mode shuffled
pc query "$W/coco-gpu.parquet" "SELECT count(*) AS pairs, max(abs(a.sim - b.sim)) AS gpu_vs_share FROM scores a JOIN share b USING (key)" \
   --attach share="$W/coco-share.parquet"
# every JPEG decoded and resized by the workers' PIL (exact: the model's own pixels): the device's pixels against
# PIL's, through the model (a decode that wrote over images still being resized would show here as a far larger
# difference); and fast, the workers' PIL decode resized by torch
pc score "$W/coco" --out "$W/coco-exact.parquet" --model ViT-B-32 --pretrained none --device "$DEVICE" --precision bf16 --decode exact --beta-mode shuffled
pc query "$W/coco-gpu.parquet" "SELECT count(*) AS pairs, max(abs(a.sim - b.sim)) AS gpu_vs_exact FROM scores a JOIN exact b USING (key)" \
   --attach exact="$W/coco-exact.parquet"
pc score "$W/coco" --out "$W/coco-fast.parquet" --model ViT-B-32 --pretrained none --device "$DEVICE" --precision bf16 --decode fast --beta-mode shuffled
pc query "$W/coco-fast.parquet" "SELECT count(*) AS pairs, max(abs(a.sim - b.sim)) AS fast_vs_exact FROM scores a JOIN exact b USING (key)" \
   --attach exact="$W/coco-exact.parquet"
# the workers' PIL decode resized on the device (gpu-resize) against PIL's resize: the resize alone differs
pc score "$W/coco" --out "$W/coco-resize.parquet" --model ViT-B-32 --pretrained none --device "$DEVICE" --precision bf16 \
   --decode gpu-resize --beta-mode shuffled
pc query "$W/coco-resize.parquet" "SELECT count(*) AS pairs, max(abs(a.sim - b.sim)) AS resize_vs_exact FROM scores a JOIN exact b USING (key)" \
   --attach exact="$W/coco-exact.parquet"
# the training loop's JPEGs decoded on the device, then resized there
pc train "$W/coco" --out "$W/run-coco-gpu" --epochs 2 --batch-size 8 --model pairclean-tiny --pretrained none --lr 1e-3 \
   --warmup-steps 1 --device "$DEVICE" --workers 2 --decode gpu
pc train "$W/coco" --out "$W/run-coco-resize" --epochs 2 --batch-size 8 --model pairclean-tiny --pretrained none --lr 1e-3 \
   --warmup-steps 1 --device "$DEVICE" --workers 2 --decode gpu-resize
pc synth toy-world --out "$W/est-world" --pairs $(( 2 * PAIRS )) --seed 1
pc synth toy-world --out "$W/world" --pairs "$PAIRS" --seed 0
pc synth toy-world --out "$W/val" --pairs $(( PAIRS / 4 )) --seed 3
pc synth train-estimator --out "$W/est" --world "$W/est-world" --device "$DEVICE" --workers "$WORKERS"
pc corrupt "$W/world/manifest.yaml" --out "$W/noisy" --ratio 0.5 --seed 0
for prec in $PRECISIONS; do
  pc score "$W/noisy/manifest.yaml" --out "$W/s-$prec.parquet" --model pairclean-toy --pretrained "$W/est/estimator.pt" \
     --device "$DEVICE" --precision $prec --workers "$WORKERS"
done
pc evaluate detection "$W/s-bf16.parquet" --truth "$W/noisy/truth/truth.parquet"
pc query "$W/s-fp32.parquet" "SELECT max(abs(a.sim - b.sim)) AS fp32_vs_bf16 FROM scores a JOIN bf16 b USING (shard, \"index\")" \
   --attach bf16="$W/s-bf16.parquet"
common=(--val "$W/val/manifest.yaml" --model pairclean-tiny --pretrained none --batch-size 128 --lr 1e-3 --warmup-steps 20 --device "$DEVICE" --workers "$WORKERS")
pc train "$W/noisy/manifest.yaml" --out "$W/run-plain" --epochs 3 --precision bf16 "${common[@]}"
pc train "$W/noisy/manifest.yaml" --out "$W/run-weights" --epochs 3 --precision bf16 --weights "$W/s-bf16.parquet" "${common[@]}"
pc train "$W/noisy/manifest.yaml" --out "$W/run-online" --epochs 3 --precision bf16 --online \
   --estimator-model pairclean-toy --estimator-pretrained "$W/est/estimator.pt" "${common[@]}"
[ "$DEVICE" = cpu ] || pc train "$W/noisy/manifest.yaml" --out "$W/run-fp16" --epochs 1 --precision fp16 "${common[@]}"
pc evaluate retrieval "$W/val/manifest.yaml" --model "$W/run-weights" --device "$DEVICE"
echo "work directory: $W"; [ "$failed" = 0 ] && echo "all CUDA paths ran" || { echo "some command failed"; exit 1; }
