#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one call on a fresh, lent GPU machine (issues 31, 53), most
# valuable first, so a call cut short still returns what matters:
#   1. the interpreter that holds torch becomes `python` on PATH (a wrapper that execs it: a symlink is
#      not enough there), the repository on PYTHONPATH (nothing to build), the packages the image lacks
#      installed from the wheels carried in benchmarks/wheels/ (benchmarks/fetch_gpu_wheels.sh, here);
#   2. the smoke, about a minute: every CUDA-only branch (benchmarks/cuda_smoke.py: the device decoders'
#      pixels and failed rows against the CPU's, `score --decode gpu` fp32/bf16 against the CPU's rows and
#      sims, the fused text path, the compiled towers, a training epoch with --decode gpu) on 64 web
#      images, a share of them bad, each branch in its own process, stopped after SMOKE_SECONDS;
#   3. web-like shards with BAD_SHARE of a crawl's other files (`synth web-shards --bad-share`);
#   4. `bench score` (queued model-only ceiling, end to end with its main process metered, pipeline
#      only): --decode gpu eager, then each other installed device decoder (nvimgcodec) eager;
#   5. a training epoch against the model's device-resident step rate (benchmarks/train_throughput.py),
#      --decode gpu;
#   6. `--engine ray` against `--engine local` on this GPU, where the image has Ray (benchmarks/ray_overhead.py);
#   7. --decode fast eager; 8. --decode gpu --compile, last (its compilation takes minutes);
#   9. with EXTRA=1 the older rounds after it (cuda_paths.sh, the profile, the decoders on one batch, a
#      share of the JPEGs in the workers, --workers auto, ranks sharing the GPU, the towers' ops).
# Each step runs under a timeout of twice what it needs (its second argument; less where less of the
# budget is left) and is skipped when less than it needs is left: a hung step costs twice its need,
# not the rest of the call. Every result is written as it is taken (bench and train_throughput write
# their JSON after each phase), and summary.json / summary.txt are rewritten after every step.
#     bash benchmarks/fetch_gpu_wheels.sh [3.12 --with-nvimgcodec]   # here, once (28 MB; 57 MB with nvImageCodec)
#     bash benchmarks/gpu_figures.sh [OUT]                  # there (the device call carries benchmarks/wheels)
# Knobs (environment): BUDGET=450 (seconds) SHARDS=12 PAIRS_PER_SHARD=2500 BAD_SHARE=0.005 MODEL=ViT-B-32
#   PRECISION=bf16 BATCH=1024 TRAIN_BATCH=512 WORKERS=(cores - 2) DEVICE=cuda SMOKE=1 SMOKE_SECONDS=20 COMPILE=1
#   TRAIN=1 RAY=1 FAST=1 EXTRA=0 MIN_SECONDS=6. A dry run on a CPU (the smoke's CPU stand-ins, every step's line):
#   DEVICE=cpu MODEL=pairclean-tiny SHARDS=2 PAIRS_PER_SHARD=64 BATCH=32 TRAIN_BATCH=32 SMOKE_SECONDS=120 \
#     BUDGET=1200 bash benchmarks/gpu_figures.sh /tmp/gfdry
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/gpu-figures}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
W="$OUT/work"
T0=$(date +%s)
BUDGET=${BUDGET:-450}
SHARDS=${SHARDS:-12}
PAIRS_PER_SHARD=${PAIRS_PER_SHARD:-2500}
BAD_SHARE=${BAD_SHARE:-0.005}
MODEL=${MODEL:-ViT-B-32}
PRECISION=${PRECISION:-bf16}
BATCH=${BATCH:-1024}
TRAIN_BATCH=${TRAIN_BATCH:-512}
CORES=$(nproc)
WORKERS=${WORKERS:-$(( CORES > 3 ? CORES - 2 : 1 ))}
DEVICE=${DEVICE:-cuda}
SMOKE=${SMOKE:-1}
SMOKE_SECONDS=${SMOKE_SECONDS:-20}
COMPILE=${COMPILE:-1}
TRAIN=${TRAIN:-1}
RAY=${RAY:-1}
FAST=${FAST:-1}
EXTRA=${EXTRA:-0}
MIN_SECONDS=${MIN_SECONDS:-6}

left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/log.txt"; }

# summarise: summary.json and summary.txt from every result written so far (partial ones too)
summarise() {
  python - "$OUT" > "$OUT/summary.txt" 2>"$OUT/summary.err" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {"smoke": {}, "scoring": {}, "train": {}, "skipped": sorted(p.stem for p in out.glob("*.skipped")),
           "timed_out": sorted(p.stem for p in out.glob("*.rc") if p.read_text().strip() in ("124", "137"))}
lines = []
for path in sorted(out.glob("smoke-*.json")):
    s = json.loads(path.read_text())
    summary["smoke"][s["branch"]] = s
    lines.append(f"smoke {s['branch']:9} {'ok' if s['ok'] else 'skipped' if s['ok'] is None else 'FAILED'}"
                 + (f" ({s.get('skipped')})" if s.get("skipped") else ""))
for path in sorted(out.glob("smoke-*.rc")):
    if path.read_text().strip() in ("124", "137"):
        lines.append(f"smoke {path.stem[6:]:9} TIMED OUT")
util = lambda v: "-" if v is None else f"{v:.0f}%"
num = lambda v, f: "-" if v is None else format(v, f)
for path in sorted(out.glob("score-*.json")):
    report = json.loads(path.read_text())
    for r in report["rounds"]:
        c, e, p = r["ceiling"], r["end_to_end"], r["pipeline_only"]
        meter = (e or {}).get("extra", {}).get("meter", {})
        steady = meter.get("pairs_per_second")
        entry = {"decode": report["config"]["decode"], "compile": report["config"]["compile"],
                 "compiled_towers": report["config"].get("compiled_towers"),
                 "ceiling_pairs_per_second": c and c["pairs_per_second"],
                 "ceiling_gpu_utilisation": c and c["extra"].get("gpu_utilisation"),
                 "end_to_end_pairs_per_second": e and e["pairs_per_second"],
                 "end_to_end_steady_pairs_per_second": steady,
                 "end_to_end_gpu_utilisation": e and e["extra"].get("gpu_utilisation"),
                 "end_to_end_errors": e and e["extra"].get("errors"),
                 "end_to_end_over_ceiling": r["end_to_end_over_ceiling"],
                 "steady_over_ceiling": steady / c["pairs_per_second"] if steady and c else None,
                 "end_to_end_stage_wall_ms_per_pair": meter.get("stage_wall_ms_per_pair"),
                 "pipeline_only_pairs_per_second": p and p["pairs_per_second"],
                 "pipeline_only_main_cpu_ms_per_pair": p and p["main_cpu_ms_per_pair"]}
        summary["scoring"][path.stem] = entry
        lines.append(f"{path.stem:22} ceiling {num(entry['ceiling_pairs_per_second'], ',.0f'):>7} "
                     f"({util(entry['ceiling_gpu_utilisation'])}) e2e {num(entry['end_to_end_pairs_per_second'], ',.0f'):>7} "
                     f"steady {num(steady, ',.0f'):>7} ({util(entry['end_to_end_gpu_utilisation'])}) "
                     f"steady/ceiling {num(entry['steady_over_ceiling'], '.2f')} pipeline-only "
                     f"{num(entry['pipeline_only_pairs_per_second'], ',.0f')} errors {entry['end_to_end_errors']}"
                     + (f" towers {entry['compiled_towers']}" if entry["compile"] else ""))
for path in sorted(out.glob("train*.json")):
    t = json.loads(path.read_text())
    summary["train"][path.stem] = t
    m, e = t.get("model_only"), t.get("end_to_end")
    lines.append(f"{path.stem}: model only {num(m and m['pairs_per_second'], ',.0f')} pairs/s, end to end "
                 f"{num(e and e['pairs_per_second'], ',.0f')}, ratio {num(t.get('end_to_end_over_model_only'), '.2f')} "
                 f"(--decode {t['config'].get('decode')}); GPU busy {util(m and m.get('gpu_utilisation'))} / "
                 f"{util(e and e.get('gpu_utilisation'))}")
if summary["skipped"]:
    lines.append("skipped (time): " + ", ".join(summary["skipped"]))
if summary["timed_out"]:
    lines.append("timed out: " + ", ".join(summary["timed_out"]))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print("\n".join(lines))
EOF
}

# step NAME NEED CMD...: CMD under a timeout of 2 x NEED (what is left of the budget, if less), its output in
# OUT/NAME.log and its status in OUT/NAME.rc (124/137: timed out); skipped (OUT/NAME.skipped) when less than
# NEED is left. The summary is rewritten after it.
step() {
  local name=$1 need=$2 rest cap rc
  shift 2
  rest=$(left)
  if (( rest < need )); then
    say "skip $name: ${rest} s of the budget left, it needs about ${need} s"
    echo "$rest" > "$OUT/$name.skipped"
    return 0
  fi
  cap=$(( 2 * need < rest ? 2 * need : rest ))
  say "start $name (at most ${cap} s)"
  timeout --kill-after=10 "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$rc" > "$OUT/$name.rc"
  say "end $name: rc=$rc"
  tail -n 3 "$OUT/$name.log" | sed 's/^/    /'
  summarise
  return 0
}

# 1. python: the interpreter that imports torch, as a wrapper script on PATH; the carried wheels
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
  step install 15 python -m pip install --no-index --no-deps $(cat "$OUT/install-list.txt")
  if ! python -c "import open_clip, webdataset, duckdb" 2>/dev/null; then  # the image's environment is read-only
    step install-target 15 python -m pip install --no-index --no-deps --target "$W/site" $(cat "$OUT/install-list.txt")
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
                  "settings": {"model": "$MODEL", "precision": "$PRECISION", "batch": $BATCH, "train_batch": $TRAIN_BATCH,
                               "workers": $WORKERS, "device": "$DEVICE", "shards": $SHARDS,
                               "pairs_per_shard": $PAIRS_PER_SHARD, "bad_share": $BAD_SHARE}}, indent=1))
EOF
say "machine: $(python -c "import json; m = json.load(open('$OUT/machine.json')); print(m['gpu'], m['cores'], 'cores')")"

# 2. the smoke: every CUDA-only branch on 64 web images, a third of them a crawl's other files
if [ "$SMOKE" = 1 ]; then
  python -m pairclean synth web-shards --src "$ROOT/tests/data/coco-mini" --out "$W/smoke" --shards 1 \
    --pairs-per-shard 64 --bad-share 0.3 --seed 3 --overwrite > "$OUT/smoke-shards.log" 2>&1
  for branch in decoders score text train compile; do
    step "smoke-$branch" $(( SMOKE_SECONDS / 2 )) python "$ROOT/benchmarks/cuda_smoke.py" "$branch" "$W/smoke" \
      --device "$DEVICE" --json "$OUT/smoke-$branch.json"
  done
fi

# 3. the shards
step shards 30 python -m pairclean synth web-shards --src "$ROOT/tests/data/coco-mini" --out "$W/web" \
  --shards "$SHARDS" --pairs-per-shard "$PAIRS_PER_SHARD" --bad-share "$BAD_SHARE" --jobs "$CORES" --overwrite
[ -f "$W/web/manifest.yaml" ] || { say "no shards: stopping"; exit 1; }

score() {  # NAME NEED DECODE [FLAGS...]
  local name=$1 need=$2 decode=$3 logs=
  shift 3
  # --compile: each recompilation logged (why, which shape) in OUT/score-NAME.log
  case " $* " in *" --compile "*) logs=TORCH_LOGS=recompiles ;; esac
  step "score-$name" "$need" env $logs python -m pairclean bench score "$W/web/manifest.yaml" --model "$MODEL" \
    --pretrained none --device "$DEVICE" --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" \
    --decode "$decode" "$@" --beta-mode shuffled --naive-pairs 0 --min-seconds "$MIN_SECONDS" \
    --json "$OUT/score-$name.json" --overwrite
}
# the other device decoders that can run here (nvimgcodec with --with-nvimgcodec's wheels)
extra_decoders=$(python -c "from pairclean.backends.device_jpeg import DEVICE_DECODERS as D
print(*(n for n, c in D.items() if n in ('nvimgcodec', 'dali') and c.unavailable() is None))" 2> "$OUT/decoders-probe.log")

# 4-7. the figures, most valuable first
score gpu-eager 45 gpu
for decode in $extra_decoders; do score "$decode-eager" 45 "$decode"; done
[ "$TRAIN" = 1 ] && step train-gpu 60 python "$ROOT/benchmarks/train_throughput.py" "$W/web/manifest.yaml" \
  --model "$MODEL" --precision "$PRECISION" --batch-size "$TRAIN_BATCH" --workers "$WORKERS" --device "$DEVICE" \
  --decode gpu --min-seconds "$MIN_SECONDS" --json "$OUT/train-gpu.json"
# issue 52: --engine ray against --engine local on this one GPU, same shards and settings (where the image has Ray:
# its wheel, ~70 MB, is over what a device call carries)
if [ "$RAY" = 1 ] && python -c "import ray" 2> /dev/null; then
  step ray-vs-local 120 python "$ROOT/benchmarks/ray_overhead.py" "$W/web/manifest.yaml" --model "$MODEL" \
    --device "$DEVICE" --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode gpu --rounds 1 \
    --no-cluster --json "$OUT/ray-vs-local.json"
elif [ "$RAY" = 1 ]; then say "ray-vs-local skipped: no Ray in this image"; fi
[ "$FAST" = 1 ] && score fast-eager 45 fast
[ "$COMPILE" = 1 ] && score gpu-compile 150 gpu --compile

# 8. the older rounds, where asked for and time is left
if [ "$EXTRA" = 1 ]; then
  step cuda-paths 150 bash "$ROOT/benchmarks/cuda_paths.sh" "$W/cuda"
  step profile 40 python "$ROOT/benchmarks/profile_score.py" "$W/web/manifest.yaml" --model "$MODEL" \
    --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode gpu --device "$DEVICE" --shards 3 \
    --out "$OUT/profile"
  step decoders 40 python "$ROOT/benchmarks/device_decoders.py" "$W/web" --device "$DEVICE" --decoders gpu $extra_decoders \
    --repeat 10 --json "$OUT/decoders.json"
  score gpu-share-0.5-eager 45 gpu --cpu-decode-share 0.5
  score gpu-auto-workers 45 gpu --workers auto
  step ranks 50 python "$ROOT/benchmarks/ranks_per_gpu.py" "$W/web/manifest.yaml" --model "$MODEL" --device "$DEVICE" \
    --precision "$PRECISION" --batch-size "$BATCH" --workers "$WORKERS" --decode gpu --ranks 2 --json "$OUT/ranks.json"
  step towers 30 python "$ROOT/benchmarks/tower_ops.py" "$W/web/manifest.yaml" --model "$MODEL" --pairs "$BATCH" \
    --device "$DEVICE" --repeat 10 --json "$OUT/towers.json"
fi

summarise
cat "$OUT/summary.txt"
say "done: $OUT"
