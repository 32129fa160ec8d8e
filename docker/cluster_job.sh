#!/usr/bin/env bash
# The 2-worker job of docker/compose.yaml and docker/build.sh --cluster, run on worker1: wait for ssh to
# worker2, then the synthetic benchmark with TernGrad and a digits training whose parameters must agree.
set -euo pipefail
cd /opt/hvd_terngrad
for _ in $(seq 60); do
  ssh -o BatchMode=yes worker2 true 2>/dev/null && break
  sleep 1
done
hosts=(-np 2 -H worker1:1,worker2:1 --network-interface eth0)
horovodrun "${hosts[@]}" python -m benchmarks.synthetic --model tiny --method terngrad \
  --num-iters 3 --num-batches-per-iter 5
horovodrun "${hosts[@]}" python -m examples.train_digits --methods terngrad --epochs 2
