#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one call on a fresh, lent GPU machine (issue 31):
#   1. the interpreter that holds torch becomes `python` on PATH (a wrapper that execs it: a
#      symlink is not enough there), and the repository is put on PYTHONPATH (nothing to build);
#   2. the packages the image lacks, installed from the wheels carried in benchmarks/wheels/
#      (fetched beforehand by benchmarks/fetch_gpu_wheels.sh: the machine cannot reach PyPI);
#   3. web-like shards (`synth web-shards`, rendered by every core);
#   4. `bench score` (model-only ceiling, end to end with its main process metered, pipeline only),
#      alternating decode gpu|fast x eager|--compile, each other installed device decoder (nvimgcodec,
#      with --with-nvimgcodec's wheels), the first decode with each CPU_SHARE of its JPEGs decoded in
#      the workers (--cpu-decode-share), and benchmarks/device_decoders.py on one batch;
#   5. a training epoch against the model's own step rate (benchmarks/train_throughput.py), then one
#      with the device decoding or resizing (each --decode of TRAIN_DECODE);
#      `pairclean score` in one process against RANKS ranks sharing the GPU (benchmarks/ranks_per_gpu.py);
#   6. benchmarks/cuda_paths.sh (every CUDA path);
#   7. benchmarks/profile_score.py: the main thread's ops, launches and synchronisations, first decode eager;
#      benchmarks/tower_ops.py: each tower's ops, ms a call and bf16 sims under autocast or not.
# Steps 4-7 interleave, the issue's first asks first: each decode eager, the other device decoders eager, the first
# with each CPU_SHARE, the first with --workers auto, RANKS ranks, the towers (30 s), training, --compile with the
# first decode, cuda_paths.sh, the profile, the decoders on one batch, the other --compile, each decode eager again.
# One JSON per variant in OUT, a log per step, summary.json and a table at the end. A step that
# would overrun the time budget is skipped and says so; every step runs under a timeout.
#     bash benchmarks/fetch_gpu_wheels.sh [3.12 --with-nvimgcodec]   # here, once (28 MB; 57 MB with nvImageCodec)
#     bash benchmarks/gpu_figures.sh [OUT]                  # there (the device call carries benchmarks/wheels)
# Knobs (environment): BUDGET=480 (seconds) SHARDS=14 PAIRS_PER_SHARD=2500 PROGRESSIVE=0 MODEL=ViT-B-32
#   PRECISION=bf16 BATCH=1024 TRAIN_BATCH=512 WORKERS=(cores - 2) DEVICE=cuda DECODES="gpu fast" CPU_SHARE="0.5" (a list; 0: none)
#   COMPILE=1 CUDA_PATHS=1 TRAIN=1 TRAIN_DECODE="gpu-resize gpu" AUTO_WORKERS=1 PROFILE=1 TOWERS=1 RANKS=2 MIN_SECONDS=8 (a CPU dry run: DEVICE=cpu MODEL=pairclean-tiny SHARDS=2 PAIRS_PER_SHARD=64
#   BATCH=32 TRAIN_BATCH=32 COMPILE=0 CUDA_PATHS=0)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/gpu-figures}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W="$OUT/work"
T0=$(date +%s)
BUDGET=${BUDGET:-480}
SHARDS=${SHARDS:-14}
PAIRS_PER_SHARD=${PAIRS_PER_SHARD:-2500}
PROGRESSIVE=${PROGRESSIVE:-0}  # share of progressive JPEGs in the shards (0: the shards of session 11's figures)
MODEL=${MODEL:-ViT-B-32}
PRECISION=${PRECISION:-bf16}
BATCH=${BATCH:-1024}
TRAIN_BATCH=${TRAIN_BATCH:-512}
CORES=$(nproc)
WORKERS=${WORKERS:-$(( CORES > 3 ? CORES - 2 : 1 ))}
DEVICE=${DEVICE:-cuda}
DECODES=${DECODES:-gpu fast}
# --cpu-decode-share of the extra eager rounds of the first decode (a device decoder), one round each. 0.5: the share
# that balanced session 14's H100 figures with the share's images decoded, not resized, in the workers (docs/benchmarks.md)
CPU_SHARE=${CPU_SHARE:-0.5}
COMPILE=${COMPILE:-1}
CUDA_PATHS=${CUDA_PATHS:-1}
TRAIN=${TRAIN:-1}
PROFILE=${PROFILE:-1}
TOWERS=${TOWERS:-1}
AUTO_WORKERS=${AUTO_WORKERS:-1}  # a round of the first decode with --workers auto
TRAIN_DECODE=${TRAIN_DECODE:-gpu-resize gpu}  # training epochs with each --decode in TRAIN_DECODE (fast: none)
RANKS=${RANKS:-2}  # ranks sharing the GPU in benchmarks/ranks_per_gpu.py (0 or 1: skipped)
MIN_SECONDS=${MIN_SECONDS:-8}

left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/log.txt"; }

# step NAME SECONDS CMD...: CMD under a timeout of the budget left, its output in OUT/NAME.log;
# skipped (OUT/NAME.skipped) when less than SECONDS are left.
step() {
  local name=$1 need=$2 rest rc
  shift 2
  rest=$(left)
  if (( rest < need )); then
    say "skip $name: ${rest} s of the budget left, it needs about ${need} s"
    echo "$rest" > "$OUT/$name.skipped"
    return 0
  fi
  say "start $name"
  timeout --kill-after=15 "$rest" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  say "end $name: rc=$rc"
  tail -n 4 "$OUT/$name.log" | sed 's/^/    /'
  return 0
}

# 1. python: the interpreter that imports torch, as a wrapper script on PATH
PY=""
for candidate in python3 python python3.12 python3.11 /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
    PY=$(command -v "$candidate")
    break
  fi
done
[ -n "$PY" ] || { say "no interpreter on this machine imports torch"; exit 1; }
mkdir -p "$OUT/bin" "$W"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" > "$OUT/bin/python"
chmod +x "$OUT/bin/python"
export PATH="$OUT/bin:$PATH" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
say "python: $PY ($(python -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"

# 2. what the image lacks, from the carried wheels (no index: the machine reaches none)
python - "$ROOT/benchmarks/wheels" > "$OUT/install-list.txt" <<'EOF'
import pathlib, sys
from importlib.metadata import PackageNotFoundError, distribution
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        distribution(wheel.name.split("-")[0])  # installed already: the image's own is kept
    except PackageNotFoundError:
        print(wheel)
EOF
if [ -s "$OUT/install-list.txt" ]; then
  step install 20 python -m pip install --no-index --no-deps $(cat "$OUT/install-list.txt")
  if ! python -c "import open_clip, webdataset, duckdb" 2>/dev/null; then  # the image's environment is read-only
    step install-target 20 python -m pip install --no-index --no-deps --target "$W/site" $(cat "$OUT/install-list.txt")
    export PYTHONPATH="$PYTHONPATH:$W/site"
  fi
fi
python -c "import pairclean.cli, open_clip, webdataset, duckdb" 2>"$OUT/import-check.log" \
  || { say "pairclean does not import here:"; cat "$OUT/import-check.log"; exit 1; }
python - > "$OUT/machine.json" <<EOF
import json, os, platform, subprocess, sys, torch, torchvision
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip() if os.path.exists("/usr/bin/nvidia-smi") else None
print(json.dumps({"gpu": gpu, "cuda_available": torch.cuda.is_available(), "torch": torch.__version__,
                  "torchvision": torchvision.__version__, "python": sys.version.split()[0], "cores": os.cpu_count(),
                  "platform": platform.platform(),
                  # 2: the cores are hyperthreads, and a worker beside a busy sibling decodes slower (session 14's
                  # workers spent 4.2 ms a pair in the run against 2.4 alone)
                  "threads_per_core": len(open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read().replace("-", ",").split(","))
                  if os.path.exists("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") else None,
                  "settings": {"model": "$MODEL", "precision": "$PRECISION",
                  "batch": $BATCH, "train_batch": $TRAIN_BATCH, "workers": $WORKERS, "device": "$DEVICE",
                  "shards": $SHARDS, "pairs_per_shard": $PAIRS_PER_SHARD, "progressive": $PROGRESSIVE}}, indent=1))
EOF
say "machine: $(python -c "import json; m = json.load(open('$OUT/machine.json')); print(m['gpu'], m['cores'], 'cores')")"

# 3. the shards
step shards 30 python -m pairclean synth web-shards --src "$ROOT/tests/data/coco-mini" --out "$W/web" \
  --shards "$SHARDS" --pairs-per-shard "$PAIRS_PER_SHARD" --progressive "$PROGRESSIVE" --jobs "$CORES" --overwrite
[ -f "$W/web/manifest.yaml" ] || { say "no shards: stopping"; exit 1; }

# 4-6. scoring variants, training, every CUDA path
score() {  # NAME DECODE [FLAGS...]
  local name=$1 decode=$2 logs=
  shift 2
  # --compile: each recompilation logged (why, which shape) in OUT/score-NAME.log, to see where compile time goes
  case " $* " in *" --compile "*) logs=TORCH_LOGS=recompiles ;; esac
  step "score-$name" 45 env $logs python -m pairclean bench score "$W/web/manifest.yaml" --model "$MODEL" --pretrained none \
    --device "$DEVICE" --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode "$decode" "$@" \
    --beta-mode shuffled --naive-pairs 0 --min-seconds "$MIN_SECONDS" --json "$OUT/score-$name.json" --overwrite
}
first=${DECODES%% *}
# share_round 1: the first decode a device decoder of JPEGs that can run here; then the other installed device decoders
probe=$(python -c "from pairclean.backends.device_jpeg import DEVICE_DECODERS as D
first = D.get('$first')
print(int(first is not None and not first.workers_decode and first.unavailable() is None),
      *(n for n, c in D.items() if n not in '$DECODES'.split() and c.unavailable() is None))" 2> "$OUT/decoders-probe.log") \
  || say "the decoder probe failed (no share round, no other decoders): $(tail -n 1 "$OUT/decoders-probe.log")"
read -r share_round extra_decodes <<< "$probe"
# in the order of what the issue asks first, so a short budget drops the least: each decode eager,
# the other device decoders, the first with each CPU_SHARE of its JPEGs in the workers, the towers,
# training, --compile with the first decode, every CUDA path, the profile, the rest
for decode in $DECODES; do score "$decode-eager-1" "$decode"; done
# the other device decoders next: session 14's H100 figures had the prefetching thread's host CPU
# (0.148 ms a pair: nvJPEG's Huffman decoding under torchvision's process-wide lock) as the bound,
# which gpu-resize (the workers decode, the device resizes: registered first) takes off every path,
# and nvImageCodec's hardware decoder and host threads may lift
for decode in $extra_decodes; do score "$decode-eager" "$decode"; done
# the first decode with a share of its JPEGs decoded (not resized) in the workers: the prefetching thread's
# nvJPEG work falls by the share, the workers' rises by ~0.5 ms a shared JPEG (session 18)
if [ "${share_round:-0}" = 1 ]; then
  for share in $CPU_SHARE; do
    [ "$share" != 0 ] && score "$first-share-$share-eager" "$first" --cpu-decode-share "$share"
  done
else
  say "no --cpu-decode-share round: first decode $first (it needs a device decoder of JPEGs that can run here)"
fi
# the first decode with the workers pairclean picks (--workers auto: at most 6 where the device decodes
# every JPEG, each worker less is one fork less at the start)
[ "$AUTO_WORKERS" = 1 ] && score "$first-auto-workers" "$first" --workers auto
# the first decode's `pairclean score` in one process, then RANKS ranks sharing the GPU (torchrun)
[ "$RANKS" -gt 1 ] && step ranks 50 python "$ROOT/benchmarks/ranks_per_gpu.py" "$W/web/manifest.yaml" --model "$MODEL" \
  --device "$DEVICE" --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode "$first" \
  --ranks "$RANKS" --json "$OUT/ranks.json"
[ "$TOWERS" = 1 ] && step towers 30 python "$ROOT/benchmarks/tower_ops.py" "$W/web/manifest.yaml" --model "$MODEL" \
  --pairs "$BATCH" --device "$DEVICE" --repeat 10 --json "$OUT/towers.json"
[ "$TRAIN" = 1 ] && step train 60 python "$ROOT/benchmarks/train_throughput.py" "$W/web/manifest.yaml" --model "$MODEL" \
  --precision "$PRECISION" --batch-size "$TRAIN_BATCH" --workers "$WORKERS" --device "$DEVICE" \
  --min-seconds "$MIN_SECONDS" --json "$OUT/train.json"
# the same epoch with the device's part of each decode in TRAIN_DECODE (fast: no such round)
for decode in $TRAIN_DECODE; do
  [ "$TRAIN" = 1 ] && [ "$decode" != fast ] && step "train-$decode" 60 python "$ROOT/benchmarks/train_throughput.py" \
    "$W/web/manifest.yaml" --model "$MODEL" --precision "$PRECISION" --batch-size "$TRAIN_BATCH" --workers "$WORKERS" \
    --device "$DEVICE" --decode "$decode" --min-seconds "$MIN_SECONDS" --json "$OUT/train-$decode.json"
done
[ "$COMPILE" = 1 ] && score "$first-compile" "$first" --compile

if [ "$CUDA_PATHS" = 1 ]; then
  step cuda-paths 150 bash "$ROOT/benchmarks/cuda_paths.sh" "$W/cuda"
fi
[ "$PROFILE" = 1 ] && step profile 40 python "$ROOT/benchmarks/profile_score.py" "$W/web/manifest.yaml" --model "$MODEL" \
  --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode "$first" --device "$DEVICE" \
  --shards 3 --out "$OUT/profile"

if [ -n "$extra_decodes" ]; then
  step decoders 40 python "$ROOT/benchmarks/device_decoders.py" "$W/web" --device "$DEVICE" --decoders gpu $extra_decodes \
    --repeat 10 --json "$OUT/decoders.json"
fi
if [ "$COMPILE" = 1 ]; then
  for decode in ${DECODES#"$first"}; do score "$decode-compile" "$decode" --compile; done
fi
for decode in $DECODES; do score "$decode-eager-2" "$decode"; done

# the table
python - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows, summary = [], {"scoring": {}, "train": None, "skipped": sorted(p.stem for p in out.glob("*.skipped"))}
for path in sorted(out.glob("score-*.json")):
    report = json.loads(path.read_text())
    (r,) = report["rounds"]
    c, e, p = r["ceiling"], r["end_to_end"], r["pipeline_only"]
    m = e["extra"].get("meter", {})
    entry = {"ceiling_pairs_per_second": c["pairs_per_second"], "ceiling_gpu_utilisation": c["extra"].get("gpu_utilisation"),
             "end_to_end_pairs_per_second": e["pairs_per_second"], "end_to_end_gpu_utilisation": e["extra"].get("gpu_utilisation"),
             "end_to_end_over_ceiling": r["end_to_end_over_ceiling"], "end_to_end_main_cpu_ms_per_pair": m.get("main_cpu_ms_per_pair"),
             "end_to_end_stage_wall_ms_per_pair": m.get("stage_wall_ms_per_pair"),
             "pipeline_only_pairs_per_second": p["pairs_per_second"], "pipeline_only_main_cpu_ms_per_pair": p["main_cpu_ms_per_pair"],
             "worker_bytes_per_pair": p["worker_bytes_per_pair"], "worker_capacity_pairs_per_second": p["worker_capacity_pairs_per_second"],
             "worker_ms_per_pair": p["worker_ms_per_pair"], "worker_cpu_ms_per_pair_in_run": p.get("worker_cpu_ms_per_pair"),
             "decode": report["config"]["decode"], "cpu_decode_share": report["config"].get("cpu_decode_share", 0.0),
             "compile": report["config"]["compile"]}
    summary["scoring"][path.stem] = entry
    util = lambda v: "-" if v is None else f"{v:.0f}%"
    rows.append(f"{path.stem:26} {entry['ceiling_pairs_per_second']:10,.0f} {util(entry['ceiling_gpu_utilisation']):>5} "
                f"{entry['end_to_end_pairs_per_second']:10,.0f} {util(entry['end_to_end_gpu_utilisation']):>5} "
                f"{entry['end_to_end_over_ceiling']:6.2f} {entry['pipeline_only_pairs_per_second']:10,.0f} "
                f"{entry['pipeline_only_main_cpu_ms_per_pair']:8.4f} {entry['worker_capacity_pairs_per_second']:10,.0f} "
                f"{entry['worker_ms_per_pair']:6.3f} {entry['worker_cpu_ms_per_pair_in_run'] or 0:6.3f}")
print(f"{'variant':26} {'ceiling/s':>10} {'util':>5} {'e2e/s':>10} {'util':>5} {'ratio':>6} {'pipe/s':>10} {'ms/pair':>8} {'workers/s':>10} "
      f"{'w ms':>6} {'in run':>6}")
print("\n".join(rows))
for train in sorted(out.glob("train*.json")):
    t = json.loads(train.read_text())
    summary[train.stem] = t
    print(f"{train.stem}: model only {t['model_only']['pairs_per_second']:,.0f} pairs/s, end to end "
          f"{t['end_to_end']['pairs_per_second']:,.0f} pairs/s, ratio {t['end_to_end_over_model_only']:.2f} "
          f"(--decode {t['config'].get('decode', 'fast')}); GPU busy {t['model_only'].get('gpu_utilisation')} / "
          f"{t['end_to_end'].get('gpu_utilisation')} %")
ranks = out / "ranks.json"
if ranks.exists():
    r = json.loads(ranks.read_text())
    summary["ranks"] = r
    print("ranks sharing the GPU:", "; ".join(f"{way} {w['whole_command_pairs_per_second']:,.0f} pairs/s whole command, "
          f"{w['scoring_loop_pairs_per_second'] or 0:,.0f} scoring loop" for way, w in r["ways"].items()),
          f"(rows differing: {r['rows_whose_sim_differs']})")
cuda = out / "cuda-paths.log"
if cuda.exists():
    lines = cuda.read_text().splitlines()
    summary["cuda_paths"] = lines[-1] if lines else ""
    print("cuda_paths.sh:", summary["cuda_paths"])
profiled = out / "profile" / "profile.json"
if profiled.exists():
    summary["profile"] = json.loads(profiled.read_text())["per_batch"]
    print("profile, per batch:", ", ".join(f"{k} {v:,.1f}" for k, v in summary["profile"].items()))
towers = out / "towers.json"
if towers.exists():
    summary["towers"] = json.loads(towers.read_text())
    for way in summary["towers"]["ways"]:
        if "error" in way:
            print(f"towers, {way['way']}: failed: {way['error']}")
            continue
        print(f"towers, {way['way']}: image {way['image_ops']} ops {way['image_ms']:.1f} ms, text {way['text_ops']} ops "
              f"{way['text_ms']:.1f} ms a call of {summary['towers']['pairs']}")
if summary["skipped"]:
    print("skipped (time):", ", ".join(summary["skipped"]))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
say "done: $OUT"
