#!/bin/sh
# Run a command inside a memory-capped cgroup and print the cgroup's peak usage afterwards.
#
#   benchmarks/run_capped.sh 512M hf-merge merge CKPT OUT
#
# cgroup v2 (unified): a child of the root group, memory.max = LIMIT, memory.swap.max = 0.
# cgroup v1: /sys/fs/cgroup/memory/hf-merge-cap, memory.limit_in_bytes = LIMIT.
# Needs root (or a delegated cgroup). With systemd the same is
#   systemd-run --scope -p MemoryMax=512M -p MemorySwapMax=0 hf-merge merge CKPT OUT
# The limit counts page cache too: the kernel reclaims it under the cap, only anonymous memory
# (heap, tensors) must fit. An out-of-memory kill shows as "Killed" / exit status 137.
set -eu
limit=$1; shift
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    cg=/sys/fs/cgroup/hf-merge-cap
    mkdir -p "$cg"
    echo "$limit" > "$cg/memory.max"
    echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
    peak="$cg/memory.peak"
else
    cg=/sys/fs/cgroup/memory/hf-merge-cap
    mkdir -p "$cg"
    echo "$limit" > "$cg/memory.limit_in_bytes"
    echo 0 > "$cg/memory.max_usage_in_bytes"
    peak="$cg/memory.max_usage_in_bytes"
fi
status=0
sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' capped "$cg" "$@" || status=$?
echo "cgroup $cg: limit $limit, peak usage $(cat "$peak" 2>/dev/null || echo '?') bytes (page cache included), exit status $status" >&2
exit $status
