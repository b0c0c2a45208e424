#!/usr/bin/env bash
# How the GPU figures in BENCHMARKS.md were produced: run on the GPU machine from the repo
# root, with the wheels of DEVICE.md in .whl/ (trio, kvikio...).  Each step logs to $OUT.
#   bench/on_gpu.sh tests io io-graphs io-fg io-pages gil io-small copy-calls spill-parts profile profile-latency profile-sweep demo e2e fuzz tp rebuild sweep graphs-ab fg-ab pages-ab kernel-ab tree-ab
# tests: the GPU test files (TESTS_FILES replaces the list).
# sweep: the open-loop offered-load sweep of bench/sweep.py, one (pressure, history) cell per
# call: SWEEP_PRESSURE (default 3) and SWEEP_HISTORIES (default 4096), configurations
# SWEEP_CONFIGS (default cd), SWEEP_SEEDS seeds (default 3), layer shape SWEEP_MODELS
# (default 70b-class with 2 layers; SWEEP_MODELS=8b-class SWEEP_LAYERS=4 SWEEP_POOL_GIB=1
# SWEEP_BLOCK=64 for the second shape), disk tier SWEEP_DISK_GIB (default 8: it must hold
# the working set; twice it must be free under $DISK), grid SWEEP_RATES (multiples of the
# calibrated recompute capacity; the sweep's own when unset), SWEEP_ARGS appended (a flag
# given again there wins).  It stops itself cleanly at --deadline-s 530, inside the 560 s
# limit, keeping what it measured in bench/results/sweep-<machine>-<date>-<shape>-p<P>-h<H>.json
# (in $OUT/results.tar).  A cell longer than one call goes on in the next: put that file
# back under bench/results/ and run again with SWEEP_RESUME=<that path> (the same SWEEP_*
# values), or SWEEP_RESUME=auto for the newest file of the cell there; SWEEP_REMEASURE=d
# with SWEEP_REMEASURE_WHY="..." searches those configurations of the resumed file again from
# the start (their old points stay in it, with the reason).  A file measured before 81c5638
# (points run without the heap frozen) resumes with SWEEP_ARGS=--no-gc-freeze.  The plots are drawn afterwards
# where matplotlib is: python -m bench.sweep --plot FILE.
set -uo pipefail
OUT=${OUT:-/tmp/statekv-gpu-out}
mkdir -p "$OUT"
touch "$OUT/.started"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "${SITE:=/tmp/site}" .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
# The tree copied here has no git metadata of its own (a git found above it names another
# tree): the caller sends the commit it copied, written before the call with
#   echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" > .whl/COMMIT
if [ -f .whl/COMMIT ]; then export STATEKV_COMMIT=$(cat .whl/COMMIT); fi
echo "commit measured: ${STATEKV_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The machine named in every results file: the GPU this call got (a call may be given an H100
# for an H200), or MACHINE=... to name it yourself.
if [ -z "${MACHINE:-}" ]; then
    case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in
    *H100*) MACHINE=h100 ;; *H200*) MACHINE=h200 ;;
    *) echo "no H100 or H200 found by nvidia-smi: set MACHINE"; exit 1 ;;
    esac
fi
echo "machine: $MACHINE"
DISK=${DISK:-/tmp/statekv-disk}
mkdir -p "$DISK"
# A sweep cell's shape, as the sweep and graphs-ab steps run it.  2 layers of 70B-class (8 KiB
# of KV per token) with 0.5 GiB pools and 128-token (1 MiB) blocks hold the same tokens and
# move the same block size as 4 layers with 1 GiB and 64-token blocks, at twice the request
# rate: twice the requests per second of device time.
SWEEP_MODELS=${SWEEP_MODELS:-70b-class}
cell_flags=(--models "$SWEEP_MODELS" --histories "${SWEEP_HISTORIES:-4096}"
    --pressure "${SWEEP_PRESSURE:-3}" --layers "${SWEEP_LAYERS:-2}"
    --gpu-gib "${SWEEP_POOL_GIB:-0.5}" --host-gib "${SWEEP_POOL_GIB:-0.5}"
    --block-size "${SWEEP_BLOCK:-128}" --disk-gib "${SWEEP_DISK_GIB:-8}" --rounds 3
    --duration-s 8 --progress never)
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
run() {  # name, seconds allowed, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: rc=${PIPESTATUS[0]} in $((SECONDS - start)) s"
}
# An A/B of one flag in one call, each value back to back on the same machine: $1 names the
# runs and results files, $2 is the flag, the rest its values; AB_EXTRA adds flags to both.
latency_ab() {  # the step-latency phase alone (bench.io), the lock timed
    local what=$1 flag=$2; shift 2
    for how in "$@"; do
        run "io-$what-$how" ${IO_S:-160} python3 -m bench.io --machine "$MACHINE" --block-mib 2 \
        --threads 4 --blocks 512 --dir "$DISK" --model 8b-class --model-layers 4 \
        --decoders 16 --decode-steps 200 --loop-gpu-blocks 2048 --latency-only \
        --tenant-blocks 32 --tenant-in-flight 16 --tag "lat-$what-$how" --write --time-lock \
        ${AB_EXTRA:-} "$flag" "$how" ${IO_ARGS:-}
    done
}
sweep_ab() {  # one sweep point per configuration (SWEEP_CONFIGS) at AB_RATE
    local what=$1 flag=$2; shift 2
    for cfg in $(echo "${SWEEP_CONFIGS:-cd}" | grep -o .); do
        for how in "$@"; do
        run "$what-$cfg-$how" ${AB_S:-140} python3 -m bench.sweep --machine "$MACHINE" \
        --dir "$DISK/sweep" "${cell_flags[@]}" \
        --tag "$what-p${SWEEP_PRESSURE:-3}-h${SWEEP_HISTORIES:-4096}-$cfg-$how" --configs "$cfg" \
        --seeds 1 --rates "${AB_RATE:-1}" --start "${AB_RATE:-1}" --points 1 \
        ${AB_EXTRA:-} "$flag" "$how" ${SWEEP_ARGS:-}; done
    done
}
for step in "$@"; do
    case $step in
    info) run info 30 bash -c 'nvidia-smi -L; python3 -c "import torch, kvikio, trio; print(torch.__version__, torch.cuda.get_device_name(0), kvikio.__version__, trio.__version__)"; df -h /tmp | tail -1' ;;
    tests) STATEKV_TEST_DEVICE=cuda run tests ${TESTS_S:-150} python3 -m pytest -q -x \
        -p no:cacheprovider --timeout 60 --durations 5 ${TESTS_FILES:-tests/test_model_paged_attention.py tests/test_decode_graphs.py \
        tests/test_memory.py tests/test_kvikio_store.py tests/test_io_actors.py \
        tests/test_io_faults.py tests/test_batched_io.py tests/test_mac_read_paths.py \
        tests/test_disk_dir_ownership.py tests/test_vllm_layouts.py \
        tests/test_connector_machine.py tests/test_slot_format.py \
        tests/test_slot_format_upgrade.py tests/test_write_through.py \
        tests/test_close_flush.py tests/test_host_copies.py tests/test_foreground.py tests/test_pinned_tables.py \
        tests/test_page_copies.py} ;;
    io) run io ${IO_S:-160} python3 -m bench.io --machine "$MACHINE" --block-mib 2 --threads 4 --blocks 512 \
        --dir "$DISK" --model 8b-class --model-layers 4 --decoders 16 --decode-steps 200 \
        --loop-gpu-blocks 2048 --write --tag 2m ${IO_ARGS:-} ;;
    # The step-latency phase alone, the eager forward pass and then decode graphs
    # (--cuda-graphs), with the scheduler's lock timed: one pair in one call, same tenant.
    io-graphs) for how in eager graphs; do flags=(--time-lock)
        [ "$how" = graphs ] && flags+=(--cuda-graphs)
        run "io-$how" ${IO_S:-160} python3 -m bench.io --machine "$MACHINE" --block-mib 2 \
        --threads 4 --blocks 512 --dir "$DISK" --model 8b-class --model-layers 4 \
        --decoders 16 --decode-steps 200 --loop-gpu-blocks 2048 --latency-only \
        --tenant-blocks 32 --tenant-in-flight 16 --tag "lat-$how" --write "${flags[@]}" \
        ${IO_ARGS:-}; done ;;
    # The step-latency phase alone with the serving loop's foreground off and then on (the
    # cache's threads wait their turn while the serving thread works), the lock timed:
    # one pair in one call, same tenant.  IO_ARGS=--cuda-graphs for the graph replays.
    io-fg) latency_ab fg --foreground off on ;;
    # The step-latency phase with the serving loop's steps waiting for every copy on the
    # copy stream and then only for their own pages' (StateKVConfig.compute_waits), the
    # foreground on: one pair in one call, same tenant.
    io-pages) AB_EXTRA="--foreground on" latency_ab waits --compute-waits all pages ;;
    # The decode pass beside a thread running Python in bursts, eager and as a graph
    # replay: the interpreter lock's cost without the disk.
    gil) run gil ${GIL_S:-200} python3 -m bench.gil_contention --machine "$MACHINE" --device cuda \
        --model 8b-class --model-layers 4 --decodes 16 --context 512 --cuda-graphs --write \
        ${GIL_ARGS:-} ;;
    # An admission's copies (evict, recall into the page, alternating) through the copy
    # engine, one call a run / one call as DMAs / one call as stash and moves kernels, at
    # the sweep's 1 MiB pages and at 128 KiB (bench/copy_calls.py).
    copy-calls) for kib in 1024 128; do
        run "copy-calls-$kib" ${COPY_S:-60} python3 -m bench.copy_calls --block-kib "$kib" \
        --pages $([ "$kib" = 1024 ] && echo 512 || echo 2048) --machine "$MACHINE" --write \
        --tag "${kib}k"; done ;;
    # A spill taken apart (bench/spill_parts.py), 2 MiB then 256 KiB: when the first write
    # starts after req3's call, the writes' own rate against the store alone's.
    spill-parts) for mib in 2 0.25; do
        run "spill-parts-$mib" ${PARTS_S:-90} python3 -m bench.spill_parts --block-mib "$mib" \
        --blocks $([ "$mib" = 2 ] && echo 512 || echo 2048) --device cuda --runs 3 \
        --dir "$DISK"; done ;;
    io-small) run io-small ${IO_S:-160} python3 -m bench.io --machine "$MACHINE" --block-mib 0.25 \
        --threads 4 --blocks 2048 --dir "$DISK" --skip-latency --write --tag 256k ${IO_ARGS:-} ;;
    # The 256 KiB transfer phases under py-spy (its wheel in .whl/): every thread's stacks,
    # idle ones too, as collapsed stacks in $OUT/profile-io-small.txt.  timeout wraps py-spy,
    # never the python it starts (py-spy would then sample `timeout`).
    profile) run profile ${PROFILE_S:-200} "$SITE/bin/py-spy" record --nonblocking --threads \
        --idle --rate 250 --format raw -o "$OUT/profile-io-small.txt" -- python3 -m bench.io \
        --machine "$MACHINE" --block-mib 0.25 --threads 4 --blocks 2048 --dir "$DISK" --skip-latency ;;
    # The 2 MiB step-latency phase alone (--latency-only) under py-spy, the same way: where
    # the serving thread's steps wait while the disk is busy ($OUT/profile-io-latency.txt).
    # PROFILE_NATIVE=1 records native frames too (py-spy then pauses the process for each
    # sample, so at 40 Hz): what shows a torch call waiting to take the interpreter lock
    # back, which Python frames alone cannot.  IO_ARGS as for io.
    profile-latency) if [ -n "${PROFILE_NATIVE:-}" ]; then how=(--native --rate 40)
        else how=(--nonblocking --rate 250); fi
        run profile-latency ${PROFILE_S:-400} "$SITE/bin/py-spy" record "${how[@]}" \
        --threads --idle --format raw -o "$OUT/profile-io-latency.txt" \
        -- python3 -m bench.io --machine "$MACHINE" --block-mib 2 --threads 4 --blocks 512 \
        --dir "$DISK" --model 8b-class --model-layers 4 --decoders 16 --decode-steps 200 \
        --loop-gpu-blocks 2048 --latency-only ${IO_ARGS:-} ;;
    # One (d) point of the 16k pressure-3 sweep cell (x0.7711) under py-spy, the same way:
    # where the serving loop's steps go when admission, not compute, bounds it
    # ($OUT/profile-sweep.txt).
    profile-sweep) run profile-sweep ${PROFILE_S:-200} "$SITE/bin/py-spy" record \
        --nonblocking --threads --idle --rate 100 --format raw -o "$OUT/profile-sweep.txt" \
        -- python3 -m bench.sweep --machine "$MACHINE" --dir "$DISK/sweep" --models 70b-class \
        --tag profile --histories 16384 --pressure 3 --configs d --seeds 1 --layers 2 \
        --gpu-gib 0.5 --host-gib 0.5 --block-size 128 --disk-gib 8 --rounds 3 \
        --duration-s 8 --rates 0.7711 --points 1 --progress never ${SWEEP_ARGS:-} ;;
    demo) run demo 60 python3 -m models.demo --device cuda --users 16 --rounds 4 ;;
    e2e) run e2e ${E2E_S:-200} python3 -m bench.e2e --machine "$MACHINE" --dir "$DISK/e2e" --write \
        ${E2E_ARGS:-} ;;
    sweep) cell="${SWEEP_MODELS//,/-}-p${SWEEP_PRESSURE:-3}-h${SWEEP_HISTORIES:-4096}"
        cell=${cell//,/-}
        resume=${SWEEP_RESUME:-}
        if [ "$resume" = auto ]; then
            resume=$(ls -t bench/results/sweep-"$MACHINE"-*-"$cell".json 2>/dev/null | head -1)
            echo "SWEEP_RESUME=auto: ${resume:-no file of cell $cell, starting afresh}"
        fi
        # A resumed sweep goes on in its own file: --tag only for a new one.
        tag=(--tag "$cell"); [ -n "$resume" ] && tag=()
        run sweep ${SWEEP_S:-560} python3 -m bench.sweep --machine "$MACHINE" --dir "$DISK/sweep" \
        "${cell_flags[@]}" ${tag[@]+"${tag[@]}"} --configs "${SWEEP_CONFIGS:-cd}" \
        --seeds "${SWEEP_SEEDS:-3}" ${SWEEP_RATES:+--rates "$SWEEP_RATES"} --deadline-s 530 \
        ${resume:+--resume "$resume"} \
        ${SWEEP_REMEASURE:+--remeasure "$SWEEP_REMEASURE" --remeasure-why "${SWEEP_REMEASURE_WHY:-}"} \
        ${SWEEP_ARGS:-} ;;
    # One point of the sweep's cell (the SWEEP_* shape as for sweep) at AB_RATE
    # (a multiple of each call's calibrated capacity, default 1) per configuration of
    # SWEEP_CONFIGS, the eager pass and then decode graphs (--cuda-graphs) back to back:
    # whether replaying decode-only steps moves what a configuration sustains there.
    # AB_HOWS=graphs runs the graphs alone (after a tree-ab of the same point in one call,
    # whose new tree's runs are the eager side).
    graphs-ab) for cfg in $(echo "${SWEEP_CONFIGS:-cd}" | grep -o .); do
        for how in ${AB_HOWS:-eager graphs}; do
        case $how in eager) flags=() ;; graphs) flags=(--cuda-graphs) ;;
        *) echo "AB_HOWS: eager and/or graphs, not $how"; exit 2 ;; esac
        run "ab-$cfg-$how" ${AB_S:-140} python3 -m bench.sweep --machine "$MACHINE" \
        --dir "$DISK/sweep" "${cell_flags[@]}" \
        --tag "ab-p${SWEEP_PRESSURE:-3}-h${SWEEP_HISTORIES:-4096}-$cfg-$how" --configs "$cfg" \
        --seeds 1 --rates "${AB_RATE:-1}" --start "${AB_RATE:-1}" --points 1 \
        "${flags[@]}" ${SWEEP_ARGS:-}; done; done ;;
    # The same, with the serving loop's foreground off and then on (--foreground): whether
    # keeping the cache's Python out of the serving thread's work moves what a
    # configuration sustains there.
    fg-ab) sweep_ab fg --foreground off on ;;
    # The same, each step waiting for every copy (all) and then only for its own pages'
    # (--compute-waits pages): what the copies of other requests' pages cost a
    # configuration's throughput at one rate.
    pages-ab) AB_EXTRA="--foreground on" sweep_ab waits --compute-waits all pages ;;
    # The same, the cache's page copies as one DMA a run (--copy-kernel off: at the sweep's
    # 1 MiB pages, what auto does) and then as kernels, in both directions at once (on).
    kernel-ab) sweep_ab kernel --copy-kernel off on ;;
    # The same, with the tree checked out in AB_OLD (another commit, named in AB_OLD_COMMIT
    # for its results files: git archive COMMIT | tar -x -C DIR) and then this one,
    # AB_REPEAT times in that order: what a change did to one point.  The old tree runs from its own directory (python -m imports the working
    # directory first) and writes its results file under this tree's bench/results (--out).
    tree-ab) for cfg in $(echo "${SWEEP_CONFIGS:-cd}" | grep -o .); do
        for rep in $(seq "${AB_REPEAT:-1}"); do for tree in old new; do
        dir=$PWD; commit=${STATEKV_COMMIT:-}
        if [ "$tree" = old ]; then dir=$(cd "${AB_OLD:?AB_OLD: the other tree}" && pwd)
            commit=${AB_OLD_COMMIT:?AB_OLD_COMMIT: the commit of AB_OLD, for its results}; fi
        name="tree-p${SWEEP_PRESSURE:-3}-h${SWEEP_HISTORIES:-4096}-$cfg-$tree-$rep"
        (cd "$dir" && export STATEKV_COMMIT=$commit && PYTHONPATH=$dir:$SITE \
        run "$name" ${AB_S:-140} python3 -m bench.sweep \
        --machine "$MACHINE" --dir "$DISK/sweep" "${cell_flags[@]}" --tag "$name" \
        --out "$OLDPWD/bench/results" \
        --configs "$cfg" --seeds 1 --rates "${AB_RATE:-1}" --start "${AB_RATE:-1}" \
        --points 1 ${SWEEP_ARGS:-}); done; done; done ;;
    tp) run tp ${TP_S:-240} torchrun --nproc_per_node 2 -m bench.tp_check ;;
    # The whole gpu profile runs past one call's 10 minutes on the H200 (its system machine
    # alone did not finish 300 examples in 7.5 minutes): FUZZ_MACHINES=system in one call,
    # FUZZ_MACHINES=core,threads,kill9 in another.
    fuzz) run fuzz ${FUZZ_S:-120} python3 -m fuzz --profile gpu \
        ${FUZZ_MACHINES:+--machines "$FUZZ_MACHINES"} ;;
    rebuild) run rebuild ${REBUILD_S:-300} python3 -m bench.rebuild --machine "$MACHINE" \
        --slots ${REBUILD_SLOTS:-100000} --dir "$DISK" --write ;;
    *) echo "unknown step $step" ;;
    esac
done
# Only the results files this call wrote come back (the folder holds every earlier run's),
# as one archive, $OUT/results.tar: the device returns at most 8 files a call, and a call of
# several steps writes more than that (logs, results, plots) -- results copied one by one
# were once the files left behind.  Unpack here with tar -xf FILE -C bench/results.
find bench/results -type f -newer "$OUT/.started" -printf '%f\n' 2>/dev/null \
    | tar -cf "$OUT/results.tar" -C bench/results -T - 2>/dev/null || true
