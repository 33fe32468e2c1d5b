#!/usr/bin/env bash
# Issue 27's long distillation on a lent GPU machine, in one call of at most 10 minutes.
#
#   here, once:   bash bench/gpu_distill.sh kit          (make gpu-kit: .gpu/, ignored, about 56 MB)
#   the device:   run(command="bash bench/gpu_distill.sh run 7", carry=[".gpu"], timeout_s=600)
#                 -> $OUT/run/embedder.safetensors (fp16, the shipped format), metrics.json, the run's state
#   here, after:  python -m bench.ratchet --candidate FILES_AT/run/embedder.safetensors [--ship]
#
# A drawn task has about 15 minutes of device time, start included, so a GPU run is one call whose learning rate
# decays over MINUTES of training from the shipped weights; the next GPU task goes on from whatever shipped (the
# optimiser state, ~30 MB, would not fit the 64 MiB the call carries beside the crops).
# The GPU machine has torch, ONNX Runtime and OpenCV but no network and none of the project's other packages, so
# the kit carries the crops as two packs (`ffr pack-crops`: a seeded 20,000 of UTKFace and All-Age-Faces, 26 MB, and
# CelebA-HQ's 12,000 in-the-wild adults, 18 MB, where $FFR_FACES_DIR has them), onnx2torch (pure Python, copied from this venv)
# and SFace's published file, which the run names in FFR_SFACE_FILE (its sha256 is checked before it teaches); the
# run goes through `python -m ffr.models_only`, which imports no broker, web or signing library. The run trains
# with `ffr pretrain --online`'s defaults (the queue loss and blended faces: the recipe of the shipped file, issue 50).
# One schedule across calls: `run TOTAL CALL` keeps the run in $FFR_GPU_RUN (default .gpu-run/, ignored; the device
# keeps it between calls while the machine stays warm), trains CALL minutes of the TOTAL-minute schedule (the
# learning rate decays over TOTAL: `ffr pretrain --budget-minutes TOTAL --stop-after-minutes CALL`), and copies
# it to $OUT/run. On the first H100 task two calls each with its own warm-up lost ground at every restart
# (bench/results/pretrain_gpu_h100_s42b.md); with one schedule the optimiser state stays on the device and the
# next call, with CONTINUE=1, goes on where the last stopped:
#   run(command="bash bench/gpu_distill.sh run 12 7", carry=[".gpu"])
#   run(command="CONTINUE=1 bash bench/gpu_distill.sh run 12 5", carry=[".gpu"])   at once: the machine goes back
#                                                                                  after a short idle wait
# CONTINUE=1 on a machine that no longer holds the run (a fresh one) stops in one line rather than start over
# with a schedule it cannot finish; without CONTINUE a run already there is refused, never silently resumed.
# A second call in the same task can go on from the first call's result: INIT=FILE starts from FILE instead of the
# shipped weights (through FFR_FACE_WEIGHTS; the run's metrics.json records FILE's sha256 under "start"). The tree
# and the kit already fill about 61 of the 64 MiB a call carries, so FILE has to travel in the shipped file's place:
# copy it over models/weights/face_embedder.safetensors, run with INIT=models/weights/face_embedder.safetensors, then
# `git checkout models/weights/face_embedder.safetensors` here.
#
# Issue 50's arms, side by side in one call, each its own process on the one GPU at the same time budget (the kit
# above; each arm names its loss, so the defaults do not decide the comparison):
#   the device:   run(command="bash bench/gpu_distill.sh arms 7", carry=[".gpu"], timeout_s=570)
#                 -> $OUT/ARM/embedder.safetensors and metrics.json for each arm of the set (at most 4 arms: 8
#                    files, all a call brings back)
#   here, after:  python -m bench.ratchet --candidate FILES_AT/ARM/embedder.safetensors   (each arm; no --ship)
# `arms MINUTES SET` picks the set (`bash bench/gpu_distill.sh sets` lists them):
#   mirror_rank (the default, not yet run): today's recipe (f) against the same with the teacher's targets
#          mirror-averaged (g: `--mirrored-teacher`) and with the pair-rank term (d: `--rank-weight 0.05`, whose
#          gradient on the embeddings is then about half the recipe's at the shipped weights), a third of the GPU each;
#   s50:   the four first arms (run on the third GPU task, bench/results/ratchet_arm_s50_*.md);
#   relight: today's recipe (f) against the same with relit faces (h: `--relight-fraction 0.25`), half the GPU each.
# Each arm trains MINUTES (equal time: an arm whose step costs more, as g's twice-run teacher does, sees fewer
# samples), or with EPOCHS=E set, E passes over the kit's crops each (equal samples, the learning rate decaying over
# the steps) with MINUTES as the guard: an arm the guard stops says "paused" in its metrics and is not comparable.
#   run(command="EPOCHS=20 bash bench/gpu_distill.sh arms 8", carry=[".gpu"], timeout_s=570)
#   (20 passes: about 0.63 M samples an arm, as many as each of the s50 arms saw; three processes share a GPU
#   that trained one at 6,000-6,300 samples a second, so g, the slowest, should end inside the 8 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${FFR_GPU_KIT:-.gpu}
# ARM|pretrain options beyond the shared ones; @ is the kit (old.npz, celebahq.npz)
ARMS_s50=(
  "a_cosine_old|--data @old.npz --loss cosine --mix-fraction 0"
  "b_cosine_celebahq|--data @old.npz --data @celebahq.npz --loss cosine --mix-fraction 0"
  "c_queue_celebahq|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0"
  "e_mix_celebahq|--data @old.npz --data @celebahq.npz --loss cosine --mix-fraction 0.25"
)
ARMS_mirror_rank=(
  "f_recipe|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0.25"
  "g_mirrored_teacher|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0.25 --mirrored-teacher"
  "d_rank|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0.25 --rank-weight 0.05"
)
# h: why relit faces, bench/results/ratchet_cpu_relight_step1960_*.md
ARMS_relight=(
  "f_recipe|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0.25"
  "h_relight|--data @old.npz --data @celebahq.npz --loss queue --mix-fraction 0.25 --relight-fraction 0.25"
)
ARM_SETS=(mirror_rank s50 relight)

arm_set() {  # the arms of set $1 (a name in ARM_SETS, so a new set is its ARMS_ array listed there) into ARMS
  local known arms
  for known in "${ARM_SETS[@]}"; do  # only a listed name reaches the indirection below, never $1 itself
    if [[ "$1" == "$known" ]]; then arms="ARMS_${known}[@]"; ARMS=("${!arms}"); return; fi
  done
  echo "no arm set '$1': one of ${ARM_SETS[*]} ('bash bench/gpu_distill.sh sets' lists them)" >&2; exit 2
}

teacher_site() {  # onnx2torch and SFace's published file into the kit folder $1
  local PY=$1 kit=$2 site
  mkdir -p "$kit/site"
  site=$("$PY" -c "import onnx2torch, pathlib; print(pathlib.Path(onnx2torch.__file__).parent.parent)")
  rm -rf "$kit/site/onnx2torch"
  cp -r "$site/onnx2torch" "$kit/site/"
  find "$kit/site" -name __pycache__ -prune -exec rm -rf {} +
  cp "$("$PY" -c "from models.networks.teacher import sface_source; print(sface_source())")" "$kit/sface.onnx"
}

case "${1:-}" in
  kit)
    PY=${PYTHON:-.venv/bin/python}
    FACES=${FFR_FACES_DIR:-../shared/faces}
    teacher_site "$PY" "$KIT"
    # a call carries 64 MiB with the tree: the old sets (35,000 crops) go as a seeded 20,000 beside CelebA-HQ
    [ -f "$KIT/old.npz" ] || "$PY" -m ffr.models_only pack-crops --data "$FACES/utkface_aligned" \
      --data "$FACES/all_age_faces_aligned" --max-images 20000 --out "$KIT/old.npz"
    if [ -d "$FACES/celebahq_aligned" ] && [ ! -f "$KIT/celebahq.npz" ]; then
      "$PY" -m ffr.models_only pack-crops --data "$FACES/celebahq_aligned" --out "$KIT/celebahq.npz"
    fi
    rm -f "$KIT/faces.npz"  # an older kit's single pack: with the two above it would not fit a call
    du -sh "$KIT"
    ;;
  run)
    MINUTES=${2:?usage: bench/gpu_distill.sh run MINUTES [CALL_MINUTES]}
    CALL=${3:-}
    [ -f "$KIT/old.npz" ] && [ -f "$KIT/sface.onnx" ] && [ -d "$KIT/site/onnx2torch" ] ||
      { echo "no kit in $KIT: run 'make gpu-kit' here and carry it" >&2; exit 2; }
    KIT=$(cd "$KIT" && pwd)
    DATA=(--data "$KIT/old.npz")
    [ -f "$KIT/celebahq.npz" ] && DATA+=(--data "$KIT/celebahq.npz")
    export PYTHONPATH="$KIT/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" FFR_SFACE_FILE="$KIT/sface.onnx"
    export FFR_CACHE_DIR=${FFR_CACHE_DIR:-/tmp/ffr-cache} TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
    if [ -n "${INIT:-}" ]; then
      [ -f "$INIT" ] || { echo "INIT names a missing file: $INIT" >&2; exit 2; }
      export FFR_FACE_WEIGHTS=$(cd "$(dirname "$INIT")" && pwd)/$(basename "$INIT")
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    : "${OUT:?the device tool sets OUT}"
    RUN="$OUT/run" SPLIT=()
    if [ -n "$CALL" ]; then  # one schedule over several calls: the run stays where the next call finds it
      RUN=${FFR_GPU_RUN:-.gpu-run} SPLIT=(--stop-after-minutes "$CALL")
      if [ -n "${CONTINUE:-}" ]; then
        [ -f "$RUN/progress.json" ] ||
          { echo "CONTINUE=1 but no run in $RUN here (a fresh machine?): start again without CONTINUE" >&2; exit 2; }
        SPLIT+=(--resume)
        echo "going on with $RUN" >&2
      elif [ -e "$RUN" ]; then
        echo "$RUN already holds a run: CONTINUE=1 goes on with it; remove it to start a new one" >&2; exit 2
      fi
    fi
    "${PYTHON:-python3}" -m ffr.models_only pretrain "${DATA[@]}" --out "$RUN" \
      --device "${FFR_GPU_DEVICE:-cuda}" --online --init face --batch-size "${BATCH:-512}" --lr "${LR:-1.5e-3}" \
      --warmup-steps "${WARMUP:-100}" --budget-minutes "$MINUTES" --checkpoint-every 60 "${SPLIT[@]}" ${EXTRA:-}
    if [ "$RUN" != "$OUT/run" ]; then
      mkdir -p "$OUT/run" && cp "$RUN"/* "$OUT/run/"
    fi
    ;;
  sets)
    for set in "${ARM_SETS[@]}"; do
      arm_set "$set"
      for arm in "${ARMS[@]}"; do echo "$set  ${arm%%|*}  ${arm#*|}"; done
    done
    ;;
  arms)
    MINUTES=${2:?usage: bench/gpu_distill.sh arms MINUTES [SET]}
    arm_set "${3:-mirror_rank}"
    if [ -n "${EPOCHS:-}" ]; then SCHEDULE=(--epochs "$EPOCHS" --stop-after-minutes "$MINUTES")
    else SCHEDULE=(--budget-minutes "$MINUTES"); fi
    [ -f "$KIT/old.npz" ] && [ -f "$KIT/celebahq.npz" ] && [ -f "$KIT/sface.onnx" ] ||
      { echo "no kit with CelebA-HQ in $KIT: run 'make gpu-kit' here (with celebahq_aligned in the faces folder) and carry it" >&2; exit 2; }
    KIT=$(cd "$KIT" && pwd)
    export PYTHONPATH="$KIT/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" FFR_SFACE_FILE="$KIT/sface.onnx"
    export FFR_CACHE_DIR=${FFR_CACHE_DIR:-/tmp/ffr-cache} TQDM_MININTERVAL=${TQDM_MININTERVAL:-30}
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    : "${OUT:?the device tool sets OUT}"
    WORK=${FFR_GPU_RUN:-/tmp/ffr-arms}
    pids=()
    for arm in "${ARMS[@]}"; do
      name=${arm%%|*} options=${arm#*|}
      options=${options//@/$KIT/}
      ("${PYTHON:-python3}" -m ffr.models_only pretrain ${options} --out "$WORK/$name" --force \
        --device "${FFR_GPU_DEVICE:-cuda}" --online --init face --batch-size "${BATCH:-512}" --lr "${LR:-1.5e-3}" \
        --warmup-steps "${WARMUP:-100}" "${SCHEDULE[@]}" --checkpoint-every 600 --threads 4 \
        --no-yield-cpu ${EXTRA:-}) > "$WORK.$name.log" 2>&1 &
      pids+=($!)
    done
    failed=0
    for i in "${!pids[@]}"; do
      name=${ARMS[$i]%%|*}
      wait "${pids[$i]}" || { failed=1; echo "arm $name failed:" >&2; }
      tail -n 2 "$WORK.$name.log" | cut -c1-300
      "${PYTHON:-python3}" -c "import json,sys; m=json.load(open(sys.argv[1])); h=m['history'];
print(sys.argv[2], m['status'], 'step', m['step'], 'samples', m['samples'], 'first', h[0], 'last', h[-1])" "$WORK/$name/metrics.json" "$name" || true
      mkdir -p "$OUT/$name"
      cp "$WORK/$name/embedder.safetensors" "$WORK/$name/metrics.json" "$OUT/$name/" 2>/dev/null || true
    done
    exit $failed
    ;;
  *)
    echo "usage: bench/gpu_distill.sh kit | run MINUTES [CALL_MINUTES] | arms MINUTES [SET] | sets" >&2
    exit 2
    ;;
esac
