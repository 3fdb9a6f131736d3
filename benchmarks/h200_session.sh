#!/usr/bin/env bash
# The H200 runs the open issues need, cut to fit the device tool: one phase per call (10 minutes
# at most), results under $OUT, the compile cache carried from call to call (device_cache.sh).
#
#   run(command="bash benchmarks/h200_session.sh smoke")                              # 1 min: runner correct?
#   run(command="bash benchmarks/h200_session.sh next16")                              # 5 min: scalar inputs, smoke
#   run(command="bash benchmarks/h200_session.sh step",    carry=[".device_cache"])   # issue 3 table
#   run(command="bash benchmarks/h200_session.sh memory",  carry=[".device_cache"])   # issue 4, batch 64
#   run(command="bash benchmarks/h200_session.sh memory+search ...")                  # batch 64 + 20 GiB search
#   run(command="bash benchmarks/h200_session.sh memorypeak ...")                     # where apollo's peak is set
#   run(command="bash benchmarks/h200_session.sh lowbudget ...")                      # budget 0.05 vs per-block ckpt
#   run(command="bash benchmarks/h200_session.sh peakmodel ...")                      # budget 0.05 at batch 64, then searched
#   run(command="bash benchmarks/h200_session.sh memory256 ...")                      # issue 4, batch 256
#   run(command="bash benchmarks/h200_session.sh search ...")                         # 20 GiB search only
#   run(command="bash benchmarks/h200_session.sh profile ...")                        # the timeline
#   run(command="bash benchmarks/h200_session.sh diagmem ...")                        # what is alive at each step's peak
#   run(command="bash benchmarks/h200_session.sh smoke+memory ...")                   # smoke, then targets 1 and 2
#   run(command="bash benchmarks/h200_session.sh probe1024 ...")                      # target 3 from batch 1024 up
#   run(command="bash benchmarks/h200_session.sh check+probe ...")                    # base fp32 exactness, batch 1024
#   run(command="bash benchmarks/h200_session.sh diag1024 ...")                       # what sets the peak at batch 1024
#   run(command="bash benchmarks/h200_session.sh diag1152 ...")                       # where it runs out at 1152 (20 GiB)
#   run(command="bash benchmarks/h200_session.sh diag1152pools ...")                  # ... per pool, also with expandable segments
#   run(command="bash benchmarks/h200_session.sh step128 ...")                        # issue 3 at batch 128
#   run(command="bash benchmarks/h200_session.sh onelane64 ...")                      # budgets: one-lane forward vs measured lanes
#   run(command="bash benchmarks/h200_session.sh lanes3 ...")                         # issue 3 at 128, 32, 8: lanes vs one lane
#   run(command="bash benchmarks/h200_session.sh sidelanes ...")                      # side lanes' donation exact, then lanes3
#   run(command="bash benchmarks/h200_session.sh hostsplit ...")                      # host time per half step, no profiler
#   run(command="bash benchmarks/h200_session.sh next9 ...")                          # session 9's first call
#   run(command="bash benchmarks/h200_session.sh host9 ...")                          # host ms around each launch, 8 and 32
#   run(command="bash benchmarks/h200_session.sh final9 ...")                         # session 9's closing table
#   run(command="bash benchmarks/h200_session.sh host9b ...")                         # host9 at 8 with the C++ check
#   run(command="bash benchmarks/h200_session.sh next10 ...")                         # session 10's first call
#   run(command="bash benchmarks/h200_session.sh follow10 ...")                       # budget 0.5: backward follows forward
#   run(command="bash benchmarks/h200_session.sh edge10 ...")                         # 1152 in 20 GiB with the headroom rule
#   run(command="bash benchmarks/h200_session.sh last10 ...")                         # follow10, then batch 8 back to back
#   run(command="bash benchmarks/h200_session.sh band10 ...")                         # 1088 and 1024: captures below the bar
#   run(command="bash benchmarks/h200_session.sh band10b ...")                        # 960 and 896: where the capture fits
#   run(command="bash benchmarks/h200_session.sh next11 ...")                         # training after a failed capture; issue 3
#   run(command="bash benchmarks/h200_session.sh off11 ...")                          # offload_activations; issue 4 target 3
#   run(command="bash benchmarks/h200_session.sh offmem11 ...")                       # where the offloading step peaks
#   run(command="bash benchmarks/h200_session.sh off11b ...")                         # the 20 GiB edge with the copies in place
#   run(command="bash benchmarks/h200_session.sh offmem12 ...")                       # session 12: the offloading backward's peak, itemised
#   run(command="bash benchmarks/h200_session.sh host11 ...")                         # session 12: the host in back-to-back batch-8 steps
#   run(command="bash benchmarks/h200_session.sh dist12 ...", kind="nvidia-h200-x2")  # issue 6: DDP and FSDP2 on 2 GPUs
#   run(command="bash benchmarks/h200_session.sh place12 ...", kind="nvidia-h200-x2") # issue 6: scaling at 128, towers on 2 GPUs
#   run(command="bash benchmarks/h200_session.sh last12 ...", kind="nvidia-h200-x2")  # FSDP2 after the symbol fix; 20 GiB edge, expandable
#   run(command="bash benchmarks/h200_session.sh next13 ...")                         # session 13: the offloading edge with buffers freed at once
#   run(command="bash benchmarks/h200_session.sh next13b ...")                        # session 13: budgets free at once; edge, expandable
#   run(command="bash benchmarks/h200_session.sh next13c ...")                        # session 13: both offloading edges at 2432
#   run(command="bash benchmarks/h200_session.sh next13d ...")                        # session 13: budget-only edge past 1216?
#   run(command="bash benchmarks/h200_session.sh dist13 ...", kind="nvidia-h200-x2")  # session 13: what the one-graph DDP step adds
#   run(command="bash benchmarks/h200_session.sh offmem12 ...")                       # session 14, call 1: the same, sizes grouped
#   run(command="bash benchmarks/h200_session.sh next14 ...")                         # session 14: the stem left on the host
#   run(command="bash benchmarks/h200_session.sh next14b ...")                        # session 14: both offloading edges at 2496
#   run(command="bash benchmarks/h200_session.sh next14c ...")                        # session 14: its step time at batch 64
#   run(command="bash benchmarks/h200_session.sh next14d ...")                        # session 14: default allocator at 2176
#   run(command="bash benchmarks/h200_session.sh step14 ...")                         # session 14: issue 3 at batch 8
#   run(command="bash benchmarks/h200_session.sh stream15 ...")                       # session 15: offloading copies on their own stream
#   run(command="bash benchmarks/h200_session.sh ca15 ...")                           # session 15: batch 8 with compiled autograd
#
# The device tool stops a command at 600 s: each guard leaves ~60 s for loading and saving the
# cache (session 3's memory+search ran at 550 and lost its cache save; session 5's first call lost
# its results' log and cache to a single-threaded xz save of ~280 s, now on every core).
#
# Between calls, copy the returned inductor_cache.tar.xz.part* files into .device_cache/ (git
# ignores it). Each phase guards its benchmark with timeout so the results written so far come back.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
: "${OUT:?OUT is not set: run this through the device tool}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
bash benchmarks/device_cache.sh load
case "${1:-}" in
  smoke)     timeout 180 python benchmarks/smoke_gpu.py; exit $? ;;  # one mode compiles tiny Inductor subgraphs
  smoke+memory)  # the runner's gradients exact first (donation), then issue 4's targets 1 and 2 at batch 64;
             # no cache save: at ~50 MB it no longer comes back
             timeout 180 python benchmarks/smoke_gpu.py || exit 1
             timeout 380 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16 apollo-bf16-budget-0.5 apollo-bf16-budget-0.4 inductor-budget-0.5 --out "$OUT/mem64"
             exit $? ;;
  check+probe)  # donation exact in fp32 on the base model (Inductor subgraphs), then one probe at batch 1024
             timeout 200 python benchmarks/smoke_gpu.py --config base --batch 16 --steps 3 --mode "plain, inductor, budget"
             timeout 240 python benchmarks/bench_memory.py --batch --search-start 1024 --search-probes 1 \
               --variants apollo-bf16-budget-0.05 --search-variants apollo-bf16-budget-0.05 --out "$OUT/probe"
             exit $? ;;
  probe1024)  # issue 4's target 3: does budget 0.05 train at batch 1024 in 20 GiB (eager per-block checkpointing does)?
             timeout 420 python benchmarks/bench_memory.py --batch --search-start 1024 --search-probes 2 \
               --variants apollo-bf16-budget-0.05 --search-variants apollo-bf16-budget-0.05 --out "$OUT/probe"
             exit $? ;;
  step)      timeout 520 python benchmarks/bench_step.py --batch 8 32 --steps 50 --out "$OUT/step" ;;
  memory)    # budgets 0.5 (the walk, predicted 0.494x), 0.4 and 0.3 (per-block, relaxed: 0.399x, 0.296x);
             # target 1's rows first (a cold cache compiles ~80 s per apollo variant: the guard may cut the last)
             timeout 520 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16 apollo-bf16-budget-0.4 apollo-bf16-budget-0.3 inductor-budget-0.5 apollo-bf16-budget-0.5 \
               eager-bf16-ckpt eager-bf16 --out "$OUT/mem64" ;;
  memorypeak)  # where apollo's whole-run peak comes from (warm-up step peaks, capture), then a capture OOM
             # (budget 0.2 at batch 512) followed by eager-bf16's search: memory must come back after it
             timeout 520 python benchmarks/bench_memory.py --batch 64 --steps 10 --search-probes 2 \
               --variants eager-fp32 apollo-bf16-budget-0.3 apollo-bf16-budget-0.2 \
               --search-variants apollo-bf16-budget-0.2 eager-bf16 --out "$OUT/mempeak" ;;
  lowbudget)  # issue 4's largest-batch target: budget 0.05 (below per-block checkpointing) searched against it;
             # 3 probes: both may land in [1024, 2048), which 2 probes cannot split
             timeout 520 python benchmarks/bench_memory.py --batch 64 --steps 10 --search-probes 3 \
               --variants eager-fp32 eager-bf16-ckpt apollo-bf16-budget-0.05 \
               --search-variants eager-bf16-ckpt apollo-bf16-budget-0.05 --out "$OUT/lowbudget" ;;
  peakmodel)  # budget 0.05 (per-block fallback with attention recomputed) at batch 64, then searched (3 probes)
             timeout 420 python benchmarks/bench_memory.py --batch 64 --steps 10 --search-probes 3 \
               --variants eager-fp32 eager-bf16-ckpt apollo-bf16-budget-0.05 \
               --search-variants apollo-bf16-budget-0.05 --out "$OUT/peakmodel" ;;
  memory+search)  # batch 64, then each listed variant's largest batch in 20 GiB (2 probes each; the guard may cut the last)
             timeout 520 python benchmarks/bench_memory.py --batch 64 --steps 10 --search-probes 2 --variants eager-fp32 \
               eager-bf16 eager-bf16-ckpt inductor-budget-0.5 apollo-bf16 apollo-bf16-budget-0.2 --search-variants \
               eager-bf16-ckpt eager-bf16 eager-fp32 inductor-budget-0.5 apollo-bf16-budget-0.2 apollo-bf16 --out "$OUT/mem64s" ;;
  memory256) timeout 520 python benchmarks/bench_memory.py --batch 256 --skip-search --steps 10 --variants eager-fp32 \
               eager-bf16 eager-bf16-ckpt inductor-budget-0.5 apollo-bf16 apollo-bf16-budget-0.5 apollo-bf16-budget-0.2 \
               --out "$OUT/mem256" ;;
  search)    timeout 520 python benchmarks/bench_memory.py --batch --search-probes 2 --variants eager-bf16 eager-bf16-ckpt \
               inductor-budget-0.5 apollo-bf16-budget-0.2 --out "$OUT/search" ;;
  profile)   timeout 520 python benchmarks/profile_step.py --batch 8 32 --compare inductor-ro apollo-1lane --out "$OUT/prof"
             status=$?
             rm -f "$OUT"/prof/trace_b32.json  # keep batch 8's trace: 8 returned files, 3 go to the cache
             bash benchmarks/device_cache.sh save; exit $status ;;
  diagmem)   timeout 420 python benchmarks/diag_memory.py --batch 64 --budget 0.05 --out "$OUT/diag" ;;
  diag1024)  # target 3: apollo (budget 0.05) passes 1024 and fails 1152, eager checkpointing passes 1152:
             # which phase sets apollo's peak at 1024, and what is alive there
             timeout 420 python benchmarks/diag_memory.py --batch 1024 --budget 0.05 --out "$OUT/diag1024" ;;
  diag1152)  # ... and where it runs out at 1152 under the search's 20 GiB cap
             timeout 420 python benchmarks/diag_memory.py --batch 1152 --budget 0.05 --limit-gib 20 --out "$OUT/diag1152" ;;
  diag1152pools)  # session 7, call 2: the graph pool's free blocks at the out-of-memory error, default
             # allocator then expandable segments (no cache save: each run writes its own logs)
             timeout 250 python benchmarks/diag_memory.py --batch 1152 --budget 0.05 --limit-gib 20 --out "$OUT/default"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 250 python benchmarks/diag_memory.py \
               --batch 1152 --budget 0.05 --limit-gib 20 --out "$OUT/expandable"
             exit $? ;;
  step128)   timeout 540 python benchmarks/bench_step.py --batch 128 --steps 30 --out "$OUT/step128"
             exit $? ;;
  onelane64)  # session 7, call 5: under a budget, the forward on one lane (the rule) vs measured lanes (-fw-measured)
             timeout 430 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16-budget-0.5 apollo-bf16-budget-0.5-fw-measured apollo-bf16-budget-0.4 \
               apollo-bf16-budget-0.4-fw-measured --out "$OUT/fw1lane"
             exit $? ;;
  sidelanes)  # session 8, call 3: side lanes take over their own saved activations: exact in fp32 on the
             # base model with lanes replayed, then the lanes3 table again
             timeout 150 python benchmarks/smoke_gpu.py --config base --batch 8 --steps 3 --mode "plain, inductor"
             timeout 420 python benchmarks/bench_step.py --batch 128 8 32 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/sidelanes"
             exit $? ;;
  host9)     # session 9: where the host time goes around each launch (zero_grad, framework, apollo) at 8 and 32
             timeout 250 python benchmarks/host_split.py --batch 8 --variants inductor-ro apollo-1lane apollo
             timeout 200 python benchmarks/host_split.py --batch 32 --variants apollo-1lane apollo
             exit $? ;;
  final9)    # session 9's closing table: issue 3's benchmark at 8 and 32 on the tree with the C++ pointer check,
             # after that check's own test on a CUDA build
             timeout 60 python -m pytest -q -p no:cacheprovider tests/test_cudagraph_helpers.py -k inputs_in_place \
               2>&1 | tail -3 | tee "$OUT/pytest.txt"
             timeout 420 python benchmarks/bench_step.py --batch 8 32 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/final9"
             exit $? ;;
  next10)    # for session 10: issue 3's table with bench_step's back-to-back column (does apollo's gain hold once
             # the host's work hides behind the GPU's?)
             timeout 420 python benchmarks/bench_step.py --batch 8 32 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/next10"
             exit $? ;;
  edge10)    # for session 10: issue 4's target 3 with the headroom rule (cudagraph.py, NOTE: A capture needs
             # headroom): 1152 first (un-graphed by design?), then 1216 and 1280, the batches between eager
             # per-block checkpointing's last pass and first OOM (session 7), for both
             timeout 500 python benchmarks/bench_memory.py --batch --search-at 1152 1216 1280 --search-probes 3 \
               --variants eager-bf16-ckpt apollo-bf16-budget-0.05 \
               --search-variants eager-bf16-ckpt apollo-bf16-budget-0.05 --out "$OUT/edge10"
             exit $? ;;
  follow10)  # for session 10: issue 4's target 1 at batch 64 with the backward following its forward's measured
             # lanes (bench_memory.follow_the_forward), beside one lane and apollo's fastest plan
             timeout 420 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16 apollo-bf16-budget-0.5 apollo-bf16-budget-0.5-bw-follows --out "$OUT/follow10"
             exit $? ;;
  band10)    # session 10: the headroom rule's untested band: 1088 (first step ~83% of 20 GiB, under the 85% bar,
             # so it captures: does the capture fit?) and 1024 (~78%, captured in session 7)
             timeout 300 python benchmarks/bench_memory.py --batch --search-at 1088 1024 --search-probes 2 \
               --variants apollo-bf16-budget-0.05 --search-variants apollo-bf16-budget-0.05 --out "$OUT/band10"
             exit $? ;;
  band10b)   # session 10: band10 lost 1024 and 1088 (the backward's capture ran out at a first-step peak of
             # 81-83% of 20 GiB): where below that does the capture still fit? 960 (~76%) and 896 (~71%)
             timeout 300 python benchmarks/bench_memory.py --batch --search-at 960 896 --search-probes 2 \
               --variants apollo-bf16-budget-0.05 --search-variants apollo-bf16-budget-0.05 --out "$OUT/band10b"
             exit $? ;;
  off11)     # session 11: offload_activations (the saved block inputs wait on the host) at batch 64 against
             # per-block checkpointing with and without save_on_cpu, numerics included; then the 20 GiB edge
             python -c "import torch._functorch.config as c; print('partitioner offloading:', hasattr(c, 'enable_activation_offloading'))"
             timeout 230 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants eager-fp32 \
               eager-bf16-ckpt eager-bf16-ckpt-offload apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload \
               --out "$OUT/off64"
             timeout 330 python benchmarks/bench_memory.py --batch --variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --search-variants eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload \
               --search-at 1536 2048 --search-probes 2 --out "$OUT/off20"
             exit $? ;;
  offmem11)  # session 11: where the step peaks with offloading (apollo trained 1536 in 20 GiB, eager
             # checkpointing + save_on_cpu 2048), and where Inductor put the host copies among the kernels
             # (it ran with --without-peak-reorder, an extra row per offloading variant with Inductor's
             # reorder_for_peak_memory off; dropped once offloading subgraphs always compile that way, 2013bab)
             timeout 420 python benchmarks/offload_memory.py --batch 512 --code-dir "$OUT/code" --out "$OUT/offmem11.json"
             exit $? ;;
  off11b)    # session 11: the 20 GiB edge again with the host copies kept in place (NOTE: Host copies keep
             # their place), eager + save_on_cpu's edge above 2048, then batch 64 side by side
             timeout 250 python benchmarks/bench_memory.py --batch --variants apollo-bf16-budget-0.05-offload \
               --search-variants apollo-bf16-budget-0.05-offload --search-at 2048 1792 --search-probes 2 --out "$OUT/off20a"
             timeout 80 python benchmarks/bench_memory.py --batch --variants eager-bf16-ckpt-offload \
               --search-variants eager-bf16-ckpt-offload --search-at 2560 2304 --search-probes 2 --out "$OUT/off20e"
             timeout 180 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants eager-fp32 \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload --out "$OUT/off64b"
             exit $? ;;
  dist12)    # issue 6 on 2 GPUs (the first multi-GPU kind lent): DDP and FSDP2 with apollo against DDP +
             # Inductor and single-GPU apollo at per-GPU batch 32, the cheap and the one-graph rows first
             nvidia-smi topo -m
             timeout 500 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 20 --warmup 3 \
               --variants single-apollo ddp-eager ddp-apollo-1graph ddp-inductor ddp-apollo fsdp2-eager fsdp2-apollo \
               --out "$OUT/dist12" > "$OUT/dist12.log" 2>&1
             status=$?; grep -v "^\s*$" "$OUT/dist12.log" | grep -E "^\||\[|===|noise|FAILED|OOM|Error" | tail -c 9000
             exit $status ;;
  place12)   # issue 6 on 2 GPUs: DDP scaling at per-GPU 32 and 128 (dist12: 0.82 of 2 x single at 32), then
             # the towers placed on the two GPUs against DDP at the same global batch (64)
             timeout 250 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 128 32 --steps 20 --warmup 3 \
               --variants single-apollo ddp-apollo-1graph --out "$OUT/scale12" > "$OUT/scale12.log" 2>&1
             grep -E "^\| |\] (compile|numerics)|FAILED|OOM" "$OUT/scale12.log" | tail -c 3500
             timeout 290 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 20 --warmup 3 \
               --variants ddp-apollo-1graph onegpu-apollo placed-eager placed-apollo placed-inductor \
               --out "$OUT/place12" > "$OUT/place12.log" 2>&1
             status=$?; grep -E "^\| |\] (global|numerics)|FAILED|OOM|Error" "$OUT/place12.log" | tail -c 5000
             exit $status ;;
  last12)    # session 12, last call: fsdp2-apollo after the fix for subgraphs whose sizes name an unbound
             # symbol (dist12: one backward fell back); then, on one GPU, issue 4's 20 GiB edge with expandable
             # segments for both offloading variants (session 11: apollo's 2048 and eager's 2304 ran out with
             # 0.58 and 3.63 GiB free in pieces)
             timeout 150 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 10 --warmup 3 \
               --variants fsdp2-eager fsdp2-apollo --out "$OUT/fsdp12" > "$OUT/fsdp12.log" 2>&1
             grep -E "^\| |\] (compile|numerics)|FAILED|OOM|ApolloFallbackWarning: apollo: graph" "$OUT/fsdp12.log" | tail -c 3000
             export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
             timeout 260 python benchmarks/bench_memory.py --batch --variants apollo-bf16-budget-0.05-offload \
               --search-variants apollo-bf16-budget-0.05-offload --search-at 2048 2304 --search-probes 2 --out "$OUT/exp12a"
             timeout 100 python benchmarks/bench_memory.py --batch --variants eager-bf16-ckpt-offload \
               --search-variants eager-bf16-ckpt-offload --search-at 2304 2560 --search-probes 2 --out "$OUT/exp12e"
             exit $? ;;
  next13)    # for session 13: issue 4's target 3 with the offloading subgraphs freeing each buffer at its last
             # use (f29a527; backward peak at 512: 5.81 -> 5.22 GiB, eager + save_on_cpu 5.08): the 20 GiB edge,
             # default allocator, then batch 64 side by side (the step time of the change); then whether a
             # budget without offloading gains the same (its peaks at 512 with and without Inductor's reuse)
             timeout 250 python benchmarks/bench_memory.py --batch --variants apollo-bf16-budget-0.05-offload \
               --search-variants apollo-bf16-budget-0.05-offload --search-at 2048 2304 --search-probes 2 --out "$OUT/edge13"
             timeout 150 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload --out "$OUT/off64c"
             timeout 150 python benchmarks/offload_memory.py --batch 512 --variants apollo-bf16-budget-0.05 \
               --inductor-config allow_buffer_reuse=False --out "$OUT/reuse13.json"
             exit $? ;;
  next13b)   # session 13, call 2: every graph with a memory budget now frees each buffer at its last use
             # (NOTE: Memory first frees at once; call 1 read budget 0.05's backward peak at 512 at 7.70 GiB
             # without Inductor's reuse, 8.35 with it): batch 64 side by side (budget-only ran 31.92 ms in
             # call 1 with the reuse), then the offloading edge at 2304 / 2560 with expandable segments,
             # where eager + save_on_cpu reached [2304, 2560) in session 12
             timeout 200 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload --out "$OUT/off64d"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python benchmarks/bench_memory.py --batch \
               --variants apollo-bf16-budget-0.05-offload --search-variants apollo-bf16-budget-0.05-offload \
               --search-at 2304 2560 --search-probes 2 --out "$OUT/edge13x"
             exit $? ;;
  next13c)   # session 13, call 3: both offloading variants reach [2304, 2560) in 20 GiB with expandable segments
             # (eager + save_on_cpu in session 12, apollo in call 2): which goes further, probed at 2432
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python benchmarks/bench_memory.py --batch \
               --variants eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --search-variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --search-at 2432 --search-probes 1 --out "$OUT/edge13y"
             exit $? ;;
  next13d)   # session 13, call 5: budget 0.05 without offloading, its buffers now freed at once (call 1: backward
             # peak at 512 7.70 GiB, from 8.35): past session 10's [1152, 1216), where eager per-block checkpointing stops?
             timeout 300 python benchmarks/bench_memory.py --batch --variants apollo-bf16-budget-0.05 \
               --search-variants apollo-bf16-budget-0.05 --search-at 1216 1280 --search-probes 2 --out "$OUT/edge13z"
             exit $? ;;
  next14)    # session 14, call 2: per-block checkpointing under offloading no longer re-runs the vision stem's
             # norm from its saved input (NOTE: Offloaded per-block start; call 1's snapshot: that input held
             # 0.289 GiB over the first block's backward at 512): the peaks at 512 against eager + save_on_cpu
             # (5.08 GiB), then the 20 GiB edge with expandable segments where eager reached [2432, 2560)
             timeout 150 python benchmarks/offload_memory.py --batch 512 --variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --out "$OUT/offmem14.json"
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python benchmarks/bench_memory.py --batch \
               --variants apollo-bf16-budget-0.05-offload --search-variants apollo-bf16-budget-0.05-offload \
               --search-at 2560 2432 --search-probes 2 --out "$OUT/edge14x"
             exit $? ;;
  next14b)   # session 14, call 3: both offloading variants now pass 2432 and fail 2560 in 20 GiB with
             # expandable segments (apollo peaks at 19.00 GiB there, eager + save_on_cpu at 19.70): which passes
             # 2496; then apollo under the default allocator at 2304, where both stopped before (sessions 11, 13)
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python benchmarks/bench_memory.py --batch \
               --variants eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --search-variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --search-at 2496 --search-probes 1 --out "$OUT/edge14y"
             timeout 200 python benchmarks/bench_memory.py --batch --variants apollo-bf16-budget-0.05-offload \
               --search-variants apollo-bf16-budget-0.05-offload --search-at 2304 --search-probes 1 --out "$OUT/edge14d"
             exit $? ;;
  next14c)   # session 14, call 4: what leaving the stem on the host costs at batch 64 (its input crosses
             # PCIe twice per step now), side by side with eager + save_on_cpu (session 13: 59.9 vs 114.0 ms)
             timeout 220 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --out "$OUT/off64e"
             exit $? ;;
  next14d)   # session 14, call 5: under the default allocator both offloading variants stop in [2048, 2304)
             # (apollo's 2304 failed in call 3 with 2.34 GiB reserved but unallocated): which passes 2176
             timeout 330 python benchmarks/bench_memory.py --batch --variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --search-variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --search-at 2176 --search-probes 1 --out "$OUT/edge14e"
             exit $? ;;
  step14)    # session 14, call 6 (run as this command, before it was a phase): issue 3 at batch 8 alone,
             # what the last ~270 s of device time allowed
             timeout 430 python benchmarks/bench_step.py --batch 8 --steps 30 --out "$OUT/step14"
             exit $? ;;
  next16)    # for session 16: the host-value check (cudagraph.host_values, not yet run on a GPU): a changing
             # Python float must be exact ("unchecked" row: wrong, as session 15 measured), then the smoke
             # modes (every runner path, and batch sizes that vary) before anything long
             PYTHONPATH=. timeout 200 python benchmarks/scalar_input_probe.py || exit $?
             PYTHONPATH=. timeout 250 python benchmarks/smoke_gpu.py
             exit $? ;;
  stream15)  # for session 15: apollo's offloading copies on the compute stream (batch 64: 61 ms against 32.5
             # without offloading, session 14); with PyTorch's separate-stream offloading (-offload-stream,
             # bench_memory.offload_stream_settings) do apollo's lanes and Inductor take the stream ops, is it
             # still exact, and how much of the copy time hides? Then its peak at 512 (4.93 GiB on one stream)
             timeout 260 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants \
               apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload apollo-bf16-budget-0.05-offload-stream \
               --out "$OUT/stream64"
             timeout 200 python benchmarks/offload_memory.py --batch 512 --variants apollo-bf16-budget-0.05-offload \
               apollo-bf16-budget-0.05-offload-stream --out "$OUT/stream512.json"
             exit $? ;;
  ca15)      # for session 15, issue 3 at batch 8: the host work after the backward's launch (3.2-3.8 ms,
             # AOTAutograd and the engine's AccumulateGrad; session 13) taken into the graph by compiled
             # autograd (bench_step.CompiledAutogradStep), for reduce-overhead and apollo alike; apollo's
             # compiled-autograd backward runs on one lane (no module paths in its graph)
             timeout 520 python benchmarks/bench_step.py --batch 8 --variants inductor-ro inductor-ro-ca apollo \
               apollo-ca --steps 30 --out "$OUT/ca15"
             exit $? ;;
  dist13)    # for session 13, issue 6: what the 3-4 ms that DDP + apollo in one graph adds to one GPU's step are
             # made of (session 12: scaling 0.78-0.82 at per-GPU 32), and whether DDP's Python reducer under
             # compiled autograd (the all-reduces inside apollo's backward graph) overlaps them; DDP's copy of
             # each gradient into its bucket (gradient_as_bucket_view); then FSDP2's memory per GPU against DDP's
             timeout 260 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 20 --warmup 3 \
               --variants single-apollo ddp-apollo-1graph ddp-apollo-ca --out "$OUT/dist13a" > "$OUT/dist13a.log" 2>&1
             timeout 120 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 20 --warmup 3 \
               --variants ddp-apollo-1graph --gradient-as-bucket-view --out "$OUT/dist13b" > "$OUT/dist13b.log" 2>&1
             # memory per GPU, FSDP2 against DDP, each first in its own process (RESULTS, session 12, call 3)
             timeout 55 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 5 --warmup 2 \
               --variants ddp-eager --out "$OUT/dist13d" > "$OUT/dist13d.log" 2>&1
             timeout 55 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 5 --warmup 2 \
               --variants fsdp2-eager --out "$OUT/dist13e" > "$OUT/dist13e.log" 2>&1
             grep -hE "^20|^\| 32|\] numerics" "$OUT"/dist13?.log
             exit 0 ;;
  offmem12)  # for session 12: what apollo's backward holds at its peak with offloading, itemised (5.81 GiB
             # against eager + save_on_cpu's 5.08 at batch 512, session 11): the largest live allocations and
             # the wrapper lines that made them
             timeout 420 python benchmarks/offload_memory.py --batch 512 --variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --snapshot eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload \
               --code-dir "$OUT/code" --out "$OUT/offmem12.json"
             exit $? ;;
  next11)    # for session 11: does training go on after a backward's capture runs out (cudagraph.py, _let_go)?
             # batch 1024 in 20 GiB with cudagraphs=True: step 2 lost, the steps after it un-graphed and ok?
             # then issue 3 at 32 with the back-to-back rounds (GPU-bound there: the lanes' gain by itself)
             timeout 200 python benchmarks/capture_recovery.py --batch 1024 --budget 0.05 --limit-gib 20 --steps 6 \
               --out "$OUT/recover11"
             timeout 300 python benchmarks/bench_step.py --batch 32 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/next11"
             exit $? ;;
  host11)    # for session 11: where the host's 5.8-7.5 ms per step go when batch-8 steps are queued back to back
             # (session 10: host-bound for every compiled variant): garbage collections, cProfile's top functions
             timeout 400 python benchmarks/host_split.py --batch 8 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --b2b-profile > "$OUT/host11.txt" 2>&1
             status=$?; tail -c 6000 "$OUT/host11.txt"; exit $status ;;
  last10)    # session 10, last call: follow10 cut to fit, then issue 3 at batch 8 again with the back-to-back
             # rounds (median of 5, host ms per step); no cache save (nothing runs after it)
             timeout 320 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16 apollo-bf16-budget-0.5 apollo-bf16-budget-0.5-bw-follows --out "$OUT/follow10"
             timeout 220 python benchmarks/bench_step.py --batch 8 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/b2b8"
             exit $? ;;
  host9b)    # session 9, last call: the host breakdown again with the C++ pointer check (7173680), apollo at batch 8
             timeout 200 python benchmarks/host_split.py --batch 8 --variants apollo --steps 50
             exit $? ;;
  next9)     # for session 9: what holds the host in the two-lane backward (runner's own account, synchronizing
             # calls), then whether a budget still needs one lane now that side lanes reuse their own activations
             timeout 150 python benchmarks/host_split.py --batch 8 --variants apollo-1lane apollo --sync-debug
             timeout 380 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               apollo-bf16 apollo-bf16-budget-0.5 apollo-bf16-budget-0.5-lanes-measured --out "$OUT/mem64lanes"
             exit $? ;;
  hostsplit)  # session 8, calls 5-7 (as a scratch script): the host time of each half of the batch-8 step
             timeout 300 python benchmarks/host_split.py --batch 8
             exit $? ;;
  lanes3)    # session 8, call 1: the costliest tower on the main lane (aea8336): memory and speed against one lane
             # and reduce-overhead at every batch of issue 3, batch 128 first (the 1.1x memory bound)
             timeout 540 python benchmarks/bench_step.py --batch 128 32 8 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/lanes3"
             exit $? ;;
  *) echo "usage: $0 smoke|smoke+memory|check+probe|probe1024|step|memory|memorypeak|lowbudget|peakmodel|memory+search|memory256|search|profile|diagmem|diag1024|diag1152|diag1152pools|step128|onelane64|lanes3|sidelanes|hostsplit|next9|host9|final9|host9b|next10|follow10|edge10|last10|band10|band10b|off11|offmem11|off11b|offmem12|dist12|place12|last12|next13|next13b|next13c|next13d|next14|next14b|next14c|next14d|step14|stream15|ca15|dist13|next11|host11" >&2
     exit 2 ;;
esac
status=$?
bash benchmarks/device_cache.sh save
exit $status
