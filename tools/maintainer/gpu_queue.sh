#!/usr/bin/env bash
# Runs benchmark commands one after another in the background on the GPU machine, from a copy of
# the tree outside it (the device tool lays the tree anew on each call and ends what a call leaves
# running, unless it started its own session), so that a queue longer than one call's ten minutes
# goes on while later calls look at it.
#   bash tools/maintainer/gpu_queue.sh start "<command>" ...    (carry .whl; copies the tree, installs once)
#   bash tools/maintainer/gpu_queue.sh status                   (the tail of each log so far)
#   bash tools/maintainer/gpu_queue.sh wait <seconds>           (until the queue ends or the seconds pass, then status)
#   bash tools/maintainer/gpu_queue.sh collect <file> ...       (waits for the queue, puts files and logs in $OUT)
# Each command runs in the copy's root, with /tmp/queue/results for its files and its log in
# /tmp/queue/<n>.log; one that fails does not stop the next. The headline rows need .whl from
# `fetch_wheels.py --alone nvidia-cudnn-frontend==1.32.0 fa3-fwd==0.0.3 torchao==0.18.0` (54 MiB):
# with it the tree must stay under the device tool's 64 MiB, so the first call goes without the
# scene models (sdquant/models/scenes_*) and benchmarks/results, which no GPU benchmark reads.
set -euo pipefail
queue=/tmp/queue
action=$1
shift
case "$action" in
install)
    # The copy in /tmp/w, installed once per machine (train_scene_model_gpu.sh runs from it too).
    # Later calls copy the tree over it again: the install is editable, so a queue started after
    # a code change runs the changed code, not the first call's.
    if [ ! -f /tmp/w/.installed ]; then
        rm -rf /tmp/w && mkdir -p /tmp/w && cp -r . /tmp/w
        (cd /tmp/w && bash tools/maintainer/gpu_install.sh > /tmp/install.log 2>&1) || { tail -5 /tmp/install.log; exit 1; }
        touch /tmp/w/.installed
    elif [ "$(pwd -P)" != /tmp/w ]; then
        cp -r . /tmp/w
    fi
    ;;
start)
    bash "$0" install
    mkdir -p "$queue/results"
    script="$queue/run.sh"
    {
        echo "cd /tmp/w"
        n=0
        for command in "$@"; do
            n=$((n + 1))
            printf 'echo "$(date +%%T) start: %s" >> %s/queue.log\n' "${command//\"/\\\"}" "$queue"
            printf '(%s) > %s/%02d.log 2>&1; code=$?; echo "$(date +%%T) exit $code" >> %s/queue.log\n' "$command" "$queue" "$n" "$queue"
        done
        echo "touch $queue/done"
    } > "$script"
    rm -f "$queue/done"
    PYTHONUNBUFFERED=1 setsid nohup bash "$script" > /dev/null 2>&1 < /dev/null &
    echo "queued $# command(s); logs in $queue"
    ;;
status)
    cat "$queue/queue.log"
    for log in "$queue"/[0-9]*.log; do echo "== $log"; tail -c 600 "$log"; echo; done
    ;;
wait)
    # A call that sleeps a fixed time holds the machine idle once the queue is done; this one returns
    # as the queue ends, so the lease's next command starts at once. A fresh machine (the last one
    # given back) has no queue to wait for: say so at once rather than spend the seconds.
    [ -f "$queue/run.sh" ] || { echo "gpu_queue.sh wait: no queue on this machine (start one)" >&2; exit 1; }
    end=$((SECONDS + ${1:?give the seconds to wait at most}))
    while [ ! -f "$queue/done" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    bash "$0" status
    ;;
collect)
    while [ ! -f "$queue/done" ]; do sleep 10; done
    for file in "$@"; do cp "$queue/results/$file" "$OUT/"; done
    tar -C "$queue" -czf "$OUT/queue_logs.tar.gz" --exclude=results .
    cat "$queue/queue.log"
    ;;
*)
    echo "gpu_queue.sh: install, start, status, wait or collect, not $action" >&2
    exit 2
    ;;
esac
