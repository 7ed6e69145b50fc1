#!/usr/bin/env bash
# fp8rl's GPU stack onto an offline GPU machine that takes a bounded upload per command (PART_MB, default 55 MB,
# beside the repository) and keeps /tmp only while it stays in use. This moves the stack; what runs there is an
# ordinary fp8rl command (`fp8rl bench step --preset ...`, `python -m pipelines.submit ... --local`, pytest -m gpu),
# which holds every benchmark setting itself.
#
#   bash experiments/gpu_stack.sh pack               here: the bundle -> .carry/stack1 .. .carry/stackN (git-ignored)
#   bash experiments/gpu_stack.sh part .carry/stackK there, one command per part, back to back; the last one unpacks
#   bash experiments/gpu_stack.sh start 'CMD'        there: CMD detached (setsid), in the stack's environment; waits up
#                                                to WAIT_S (540 s) and brings back $OUT/job.log and $OUT/results.tar.gz
#                                                (every .json, .md, .log and .png CMD wrote under /tmp/res, whose path
#                                                it gets as $RES)
#   bash experiments/gpu_stack.sh poll               there: waits again for the job (a job that outlasts one command)
#   bash experiments/gpu_stack.sh pack-file FILE     here: any large file (a model's wheel, say) -> .carry/file1 .. N
#   bash experiments/gpu_stack.sh file-part .carry/fileK  there, one command per part: the file whole in /tmp/files/
#
# The bundle: vLLM (VLLM_SLIM: a tar.xz of the vllm package and its dist-info, default $TMPDIR/vllm_pack/slim.tar.xz;
# VLLM_DEPS: the wheels of vLLM's dependencies that the machine's image lacks, default .carry/vllm2/deps), Ray and its
# dependencies at constraints.txt's pins, and the project's own dependencies that a CUDA PyTorch image lacks
# (experiments/gpu_stack.txt: MLflow, the KFP SDK; versions from constraints.txt). Python 3.12, x86-64.
set -uo pipefail
step=${1:?step: pack | part DIR | start CMD | poll}; arg=${2:-}
OUT=${OUT:-.}
RES=/tmp/res

pip_download() {  # pip_download DIR SPEC...: wheels for the GPU machine's Python, no dependencies resolved here
  local dir=$1; shift
  local plat=(); for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 any; do plat+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$dir" "$@"
}

pins() {  # pins NAME...: NAME==VERSION from constraints.txt (case-insensitive; - and _ alike)
  local n
  for n in "$@"; do
    grep -i -E "^${n//[-_]/[-_]}==" constraints.txt || { echo "gpu_stack: $n has no pin in constraints.txt" >&2; return 1; }
  done
}

split_parts() {  # split_parts FILE PREFIX EXTRA: FILE in parts of PART_MB under .carry/PREFIX1..N, each with a manifest
  local file=$1 prefix=$2 extra=${3:-} size part n sha k p parts
  size=$(stat -c %s "$file"); part=$(( ${PART_MB:-55} * 1000000 )); n=$(( (size + part - 1) / part ))
  sha=$(sha256sum "$file" | cut -d' ' -f1); parts=$(mktemp -d)
  rm -rf ".carry/$prefix"*; split -n "$n" -d -a 2 "$file" "$parts/part."
  k=1
  for p in "$parts"/part.*; do
    mkdir -p ".carry/$prefix$k" && mv "$p" ".carry/$prefix$k/" && echo "$sha $n${extra:+ $extra}" > ".carry/$prefix$k/manifest.txt"
    k=$((k + 1))
  done
  rm -rf "$parts"
  grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
  du -sb ".carry/$prefix"*; echo "send .carry/${prefix}1 .. .carry/$prefix$n, one command each, back to back"
}

case $step in
  pack)
    VLLM_SLIM=${VLLM_SLIM:-${TMPDIR:-/tmp}/vllm_pack/slim.tar.xz}; VLLM_DEPS=${VLLM_DEPS:-.carry/vllm2/deps}
    [ -f "$VLLM_SLIM" ] || { echo "gpu_stack: VLLM_SLIM=$VLLM_SLIM: no such file"; exit 2; }
    [ -d "$VLLM_DEPS" ] || { echo "gpu_stack: VLLM_DEPS=$VLLM_DEPS: no such directory"; exit 2; }
    W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; mkdir -p "$W/b/deps" "$W/b/extras"
    # shellcheck disable=SC2046
    pip_download "$W/b/deps" $(pins ray click filelock jsonschema jsonschema-specifications referencing rpds-py attrs \
      msgpack protobuf pyyaml) || exit 3
    cp "$VLLM_DEPS"/*.whl "$W/b/deps/"
    # shellcheck disable=SC2046
    pip_download "$W/b/extras" $(pins $(grep -v -E '^\s*(#|$)' experiments/gpu_stack.txt)) || exit 3
    # kfp-server-api is published as a source distribution only: its (pure Python) wheel is built here
    python3 -m pip wheel -q --no-deps -w "$W/b/extras" "$(pins kfp-server-api)" || exit 3
    cp "$VLLM_SLIM" "$W/b/vllm_slim.tar.xz"
    tar -C "$W/b" -cf "$W/bundle.tar" . || exit 4
    split_parts "$W/bundle.tar" stack  # then 'part' for each
    ;;
  part)
    [ -f "$arg/manifest.txt" ] || { echo "gpu_stack: $arg/manifest.txt: no such file (a .carry/stackK of 'pack')"; exit 2; }
    [ -e /tmp/site/.stack_done ] && { echo "already installed"; exit 0; }
    mkdir -p /tmp/parts; cp "$arg"/part.* /tmp/parts/ || exit 2
    read -r sha n < "$arg/manifest.txt"; have=$(ls /tmp/parts | wc -l)
    [ "$have" -lt "$n" ] && { echo "have $have of $n parts; send the next now"; exit 0; }
    t0=$(date +%s); cat /tmp/parts/part.* > /tmp/bundle.tar; rm -rf /tmp/parts
    echo "$sha  /tmp/bundle.tar" | sha256sum -c - || exit 3
    mkdir -p /tmp/b /tmp/site /tmp/site2 && tar -C /tmp/b -xf /tmp/bundle.tar && rm /tmp/bundle.tar || exit 4
    tar -xJf /tmp/b/vllm_slim.tar.xz -C /tmp/site || exit 5
    # a dependency the image already has stays the image's; vLLM's own dependency wheels and Ray always go in
    for w in /tmp/b/deps/*.whl; do
      mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
      case $mod in pyyaml) mod=yaml;; protobuf) mod=google.protobuf;; rpds_py) mod=rpds;; esac
      case $mod in
        ray) ;;
        # the KFP SDK's generated code needs protobuf 6: an older one of the image's is shadowed
        google.protobuf) python3 -c "import google.protobuf as p, sys; sys.exit(int(p.__version__.split('.')[0]) < 6)" \
          2>/dev/null && continue;;
        click|filelock|jsonschema|jsonschema_specifications|referencing|attrs|msgpack|yaml|rpds)
          python3 -c "import $mod" 2>/dev/null && continue;;
      esac
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" || exit 6
    done
    # the project's own dependencies: last on the path, so that whatever the image or vLLM brings wins
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 /tmp/b/extras/*.whl || exit 6
    touch /tmp/site/.stack_done; rm -rf /tmp/b
    PYTHONPATH=/tmp/site:$PWD:/tmp/site2 python3 -c "import ray, vllm, mlflow, kfp, pydantic
print('IMPORT_OK ray', ray.__version__, 'vllm', vllm.__version__, 'mlflow', mlflow.__version__, 'kfp', kfp.__version__)" \
      2>&1 | tail -n 1
    echo "SETUP_SECONDS $(( $(date +%s) - t0 ))"
    ;;
  pack-file)
    [ -f "$arg" ] || { echo "gpu_stack: $arg: no such file"; exit 2; }
    split_parts "$arg" file "$(basename "$arg")"  # then 'file-part' for each
    ;;
  file-part)
    [ -f "$arg/manifest.txt" ] || { echo "gpu_stack: $arg/manifest.txt: no such file (a .carry/fileK of 'pack-file')"; exit 2; }
    read -r sha n name < "$arg/manifest.txt"
    mkdir -p "/tmp/fileparts/$name" /tmp/files && cp "$arg"/part.* "/tmp/fileparts/$name/" || exit 2
    have=$(ls "/tmp/fileparts/$name" | wc -l)
    [ "$have" -lt "$n" ] && { echo "have $have of $n parts of $name; send the next now"; exit 0; }
    cat "/tmp/fileparts/$name"/part.* > "/tmp/files/$name.tmp" && rm -rf "/tmp/fileparts/$name"
    echo "$sha  /tmp/files/$name.tmp" | sha256sum -c - >/dev/null || { echo "gpu_stack: $name: checksum mismatch"; exit 3; }
    mv "/tmp/files/$name.tmp" "/tmp/files/$name" && echo "FILE_OK /tmp/files/$name"
    ;;
  start|poll)
    # FlashInfer's sampler is not in the bundle; DeepGEMM would compile ~1,700 kernels for a block-FP8 model
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
    export PYTHONPATH=/tmp/site:$PWD:/tmp/site2 FP8RL_MODEL_CACHE=${FP8RL_MODEL_CACHE:-/tmp/models} RES
    if [ "$step" = start ]; then
      [ -n "$arg" ] || { echo "gpu_stack: start needs the command to run"; exit 2; }
      [ -e /tmp/site/.stack_done ] || { echo "gpu_stack: the stack is not installed here: send the parts first"; exit 3; }
      if [ -e $RES/job.pid ] && kill -0 "$(cat $RES/job.pid)" 2>/dev/null; then
        echo "gpu_stack: a job is still running here: poll it first"; exit 4
      fi
      rm -rf $RES; mkdir -p $RES
      setsid nohup bash -c "($arg) > $RES/job.log 2>&1; echo EXIT \$? >> $RES/job.log; touch $RES/done" \
        > /dev/null 2>&1 < /dev/null &
      echo $! > $RES/job.pid
    elif [ ! -e $RES/job.pid ]; then
      echo "gpu_stack: no job on this machine (a fresh one): start it again"; exit 3
    fi
    collect() {  # the log, and everything else in one archive (a call cut short still brings back what it has)
      mkdir -p "$OUT"; cp -f $RES/job.log "$OUT/" 2>/dev/null
      (cd $RES && find . -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.png' \
        | tar --warning=no-file-changed -czf "$OUT/results.tar.gz.tmp" -T -); [ $? -le 1 ] \
        && mv -f "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
    }
    t0=$(date +%s); seen=0; last=$t0
    while [ ! -e $RES/done ] && [ $(( $(date +%s) - t0 )) -lt "${WAIT_S:-540}" ]; do
      sleep 5; n=$(wc -l < $RES/job.log 2>/dev/null || echo 0)
      [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $RES/job.log | cut -c1-250; seen=$n; }
      [ $(( $(date +%s) - last )) -ge 30 ] && { collect; last=$(date +%s); }
    done
    collect
    [ -e $RES/done ] && echo "JOB DONE: $(tail -n 1 $RES/job.log)" || echo "JOB STILL RUNNING: poll"
    ;;
  *) echo "gpu_stack: unknown step $step (pack | part DIR | start CMD | poll)"; exit 2 ;;
esac
