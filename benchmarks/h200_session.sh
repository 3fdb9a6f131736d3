#!/usr/bin/env bash
# The H200 runs behind the tables of benchmarks/RESULTS.md, one phase per device call (the device
# tool stops a command at 600 s), results under $OUT, the compile cache carried from call to call
# (device_cache.sh). Each phase names the table it refreshes:
#
#   run(command="bash benchmarks/h200_session.sh smoke")                                 # ~5 min: the runner exact in real training; Python floats under CUDA graphs
#   run(command="bash benchmarks/h200_session.sh step",          carry=[".device_cache"]) # step time vs reduce-overhead, lanes inside the graphs: batch 8, 32, 128
#   run(command="bash benchmarks/h200_session.sh whole-step hf-clip 8", carry=[".device_cache"]) # the user's whole step
#       (zero_grad, forward, backward, fused AdamW; loss read, and back to back), module- and step-compiled, at the
#       batches named (one per call when the cache is cold); models hf-clip, hf-siglip, timm-vit-bert
#   run(command="bash benchmarks/h200_session.sh module hf-siglip 8", carry=[".device_cache"]) # memory against reduce-overhead (batch 32 in a call of its own):
#       the model compiled as a module, reduce-overhead against apollo (its first step in a pool of its own, the default)
#       and against apollo with that step in the default pool, peak and reserved as ratios
#   run(command="bash benchmarks/h200_session.sh module-memory hf-siglip 8", carry=[".device_cache"]) # where that
#       reserved surplus sits: the run's highest reserved memory, by segment, allocating line and pool (LIMIT=seconds)
#   run(command="bash benchmarks/h200_session.sh first-step-pool", carry=[".device_cache"]) # the first step in a pool of its own
#       (graph_pool.FIRST_STEP_POOL, forwards by default): reserved memory against the first step in the default pool, HF CLIP
#       b8 as a module, and HF SigLIP b8's compile_step with the optimizer inside with the pool, each beside reduce-overhead in one process
#   run(command="bash benchmarks/h200_session.sh first-step-pool-interleaved", carry=[".device_cache"]) # its time: the same
#       A/B in one process with the steps interleaved and the default twice (its control); "... interleaved siglip": compile_step
#   run(command="bash benchmarks/h200_session.sh llava",         carry=[".device_cache"]) # HF LLaVA (ViT-B/16 + 8-layer Llama), batch 8:
#       eager, Inductor's default mode, apollo as a module and compile_step, with the optimizer inside too (reduce-overhead
#       fails on it: benchmarks/RESULTS.md#hf-llava-bench_whole_step; its step is one graph from its second call, whole_step.py's NOTE)
#   run(command="bash benchmarks/h200_session.sh micro-batches", carry=[".device_cache"]) # HF LLaVA: compile_step unsplit
#       against micro_batches=2 and 4 in one graph and against accumulation one call each ("micro-batches 16": at batch 16)
#   run(command="bash benchmarks/h200_session.sh micro-batch-numerics")                     # ~8 min: micro-batches in one
#       graph train as eager accumulation with their lanes replayed, against the same graph on one lane (a tiny HF LLaVA,
#       fp32, eager and Inductor subgraphs)
#   run(command="bash benchmarks/h200_session.sh micro-batch-kernels 8", carry=[".device_cache"]) # the same, kernels and
#       timeline per step (probes/step_kernels.py): how much the micro-batches' chains overlap
#   run(command="bash benchmarks/h200_session.sh memory",        carry=[".device_cache"]) # memory table, batch 64: precision, budgets, eager checkpointing, Inductor's budget
#   run(command="bash benchmarks/h200_session.sh offload",       carry=[".device_cache"]) # offloading's step time, batch 64, against eager + save_on_cpu
#   run(command="bash benchmarks/h200_session.sh edge-budget",   carry=[".device_cache"]) # largest batch in 20 GiB: budget 0.05 against eager per-block checkpointing
#   run(command="bash benchmarks/h200_session.sh edge-offload",  carry=[".device_cache"]) # the same with offloading, default allocator
#   run(command="bash benchmarks/h200_session.sh edge-offload-x", carry=[".device_cache"]) # ... with expandable segments
#   run(command="bash benchmarks/h200_session.sh large-batch",   carry=[".device_cache"]) # the largest batch HF CLIP trains
#       under a 20 and a 40 GiB cap (bench_large_batch.py); a few tries per call: split by CAPS and VARIANTS, start at START
#       or name the batches (AT="512 640"), e.g. CAPS=20 VARIANTS=apollo-step-opt; GUARD=seconds shortens the guard
#   run(command="bash benchmarks/h200_session.sh profile",       carry=[".device_cache"]) # kernels per stream and lane overlap, batch 8 and 32 (a trace)
#   run(command="bash benchmarks/h200_session.sh host",          carry=[".device_cache"]) # the host's time per step at batch 8 (probes/host_split.py)
#   run(command="bash benchmarks/h200_session.sh step-host",     carry=[".device_cache"]) # the whole step's host time before its replay at batch 8
#       (probes/step_host.py: reduce-overhead's whole step, compile_step, compile_step with the optimizer inside)
#   run(command="bash benchmarks/h200_session.sh step-memory",   carry=[".device_cache"]) # what the whole step holds at its peak,
#       by allocating line (probes/whole_step_memory.py): reduce-overhead's whole step against compile_step with the optimizer inside
#   run(command="bash benchmarks/h200_session.sh budget-lanes-memory", carry=[".device_cache"]) # why lanes under a
#       budget hold more (HF CLIP b128, compile_step): one lane against lanes forced, pools by stream (probes/whole_step_memory.py)
#   run(command="bash benchmarks/h200_session.sh distributed", kind="nvidia-h200-x2")    # DDP scaling on 2 GPUs, per-GPU batch 32 and 128
#   run(command="bash benchmarks/h200_session.sh placement",   kind="nvidia-h200-x2")    # towers on 2 GPUs against DDP at global batch 64
#
# Before this layout (to 2026-12-01) the script held a phase per past call (next13b, off11b, ...):
# RESULTS.md's history names them; `git log -p -- benchmarks/h200_session.sh` has their commands.
#
# Each guard (timeout) leaves ~60 s of the call for loading and saving the compile cache, so the
# results written so far come back when a phase runs long. A cold cache compiles the base model
# in ~40 s per compiled variant and batch size; carried, in 5-15 s.
#
# Between calls, copy the returned inductor_cache.tar.xz.part* files into .device_cache/ (git
# ignores it), and carry it into the next call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
: "${OUT:?OUT is not set: run this through the device tool}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
bash benchmarks/device_cache.sh load
case "${1:-}" in
  smoke)     # every runner path in real training against eager (fp32, tiny model, seconds to compile), then
             # the host-value check (a changing Python float must not be replayed stale: benchmarks/RESULTS.md)
             timeout 250 python benchmarks/smoke_gpu.py || exit $?
             timeout 200 python benchmarks/probes/scalar_input_probe.py
             exit $? ;;
  step)      # the step table: reduce-overhead, apollo on one lane, apollo; each step from an idle GPU and back
             # to back, numerics against eager; the runners' own replay times give the lanes-in-graphs table
             timeout 540 python benchmarks/bench_step.py --batch 8 32 128 --variants inductor-ro apollo-1lane apollo \
               --steps 30 --out "$OUT/step" ;;
  whole-step)  # the README's table: the user's whole step, the model compiled as a module (reduce-overhead, apollo)
             # and the step compiled as one graph (reduce-overhead with backward tracing, compile_step, compile_step
             # on one lane, compile_step with the optimizer inside: apollo-step-opt); 6 compiles per batch, results kept per row;
             # VARIANTS="inductor-ro inductor-ro-step apollo-step-opt" picks some (apollo-step-opt compiles cold in about
             # 85 s; apollo-step-opt-inductor, the update as Adam's formula for Inductor to fuse, in 281-351 s), e.g.
             # VARIANTS="apollo-step-opt apollo-step-opt-inductor inductor-ro-step" A/Bs the update's two forms
             # (bench_whole_step.py's VARIANT_HELP lists every variant)
             model="${2:?whole-step needs a model: hf-clip, hf-siglip or timm-vit-bert}"; shift 2
             timeout 520 python benchmarks/bench_whole_step.py --models "$model" --batch "${@:-8}" --steps 30 \
               --variants ${VARIANTS:-inductor-ro inductor-ro-step apollo-step-opt apollo-step apollo-step-1lane apollo} \
               --out "$OUT/whole-step" ;;
  module)    # memory against reduce-overhead: module-compiled reduce-overhead and apollo, memory held between steps per pool
             model="${2:?module needs a model: hf-clip, hf-siglip or timm-vit-bert}"; shift 2
             timeout 520 python benchmarks/bench_whole_step.py --models "$model" --batch "${@:-8}" --steps 20 \
               --variants ${VARIANTS:-inductor-ro apollo apollo-no-first-step-pool} --out "$OUT/module" ;;
  module-memory)  # where the module path's reserved surplus sits: the highest reserved memory of the run
             # (first steps included) with the segments held there, by allocating line and pool, and what each
             # pool holds after the steps, reduce-overhead against apollo (probes/whole_step_memory.py)
             model="${2:?module-memory needs a model: hf-clip, hf-siglip or timm-vit-bert}"
             timeout "${LIMIT:-400}" python benchmarks/probes/whole_step_memory.py --model "$model" --batch "${3:-8}" \
               --steps 5 --variants ${VARIANTS:-inductor-ro apollo} --out "$OUT/module-memory" > "$OUT/module_memory.txt" 2>&1
             status=$?; grep -E "^######## |^== |^  (step|marker) |highest|GiB x|pool |by stream" "$OUT/module_memory.txt" | tail -c 9000; exit $status ;;
  regional)  # one compiled graph serving every layer (runtime/instances.py): each layer compiled on its own (regional
             # compilation, as accelerate's compile_regions) under reduce-overhead and apollo, beside the whole model
             # compiled; each apollo runner's summary says how many layers (instances) it served and what ran un-graphed
             model="${2:?regional needs a model: hf-clip, hf-siglip or timm-vit-bert}"; shift 2
             timeout 520 python benchmarks/bench_whole_step.py --models "$model" --batch "${@:-8}" --steps 20 \
               --variants ${VARIANTS:-inductor-ro-regional apollo-regional inductor-ro apollo} --out "$OUT/regional" ;;
  first-step-pool)  # reserved memory: the first, un-graphed step in a pool of its own against the default
             timeout 260 python benchmarks/bench_whole_step.py --models hf-clip --batch 8 --steps 20 \
               --variants inductor-ro apollo apollo-no-first-step-pool --out "$OUT/first-step-pool-module"
             timeout 260 python benchmarks/bench_whole_step.py --models hf-siglip --batch 8 --steps 20 \
               --variants inductor-ro-step apollo-step-opt apollo-step-opt-first-step-pool --out "$OUT/first-step-pool-step" ;;
  first-step-pool-interleaved)  # the same A/B in one process, the variants' steps interleaved, the default twice as a
             # control (probes/interleaved_ab.py): separate processes differed 9.15 vs 13.07 ms for one variant.
             # HF CLIP's module path (3 compiles from the cache, ~30 s each), or with "siglip" SigLIP's compile_step with
             # the optimizer inside (3 compiles take over 230 s)
             if [ "${2:-clip}" = siglip ]; then
               timeout 500 python benchmarks/probes/interleaved_ab.py --models hf-siglip --batch 8 --steps 5 --rounds 10 \
                 --variants apollo-step-opt apollo-step-opt-first-step-pool apollo-step-opt --out "$OUT/interleaved-siglip"
             else
               timeout 500 python benchmarks/probes/interleaved_ab.py --models hf-clip --batch 8 --steps 5 --rounds 12 \
                 --variants apollo apollo-no-first-step-pool apollo --out "$OUT/interleaved-clip"
             fi ;;
  llava)     # every graph replayed as a CUDA graph? the runners' summaries say (disabled, ungraphed_calls)
             timeout 520 python benchmarks/bench_whole_step.py --models hf-llava --batch 8 --steps 20 \
               --variants ${VARIANTS:-eager inductor apollo apollo-step apollo-step-opt} --out "$OUT/llava" ;;
  micro-batches)  # HF LLaVA in micro-batches: compile_step unsplit, with micro_batches=2 and 4 in its one graph, and
             # the same micro-batches accumulated one call each on the module, at the batches named (default 8)
             shift
             timeout 520 python benchmarks/bench_whole_step.py --models hf-llava --batch "${@:-8}" --steps 20 --warmup 3 \
               --variants ${VARIANTS:-apollo-step-opt apollo-step-opt-mb2 apollo-accum2 apollo-step-opt-mb4} \
               --out "$OUT/micro-batches" ;;
  micro-batch-numerics)  # micro-batches in one graph against eager accumulation on the GPU, lanes replayed
             # (a tiny HF LLaVA, fp32): each gradient's sum written across lanes (probes/micro_batch_numerics.py)
             timeout 200 python benchmarks/probes/micro_batch_numerics.py --k 2 4 2>&1 | grep -E "^k=|Error"
             eager=${PIPESTATUS[0]}  # the probe's verdict, not grep's
             timeout 320 python benchmarks/probes/micro_batch_numerics.py --compiler inductor --k 2 4 2>&1 | grep -E "^k=|Error"
             inductor=${PIPESTATUS[0]}
             exit $(( eager != 0 ? eager : inductor )) ;;
  micro-batches-and-kernels)  # both phases above in one call at batch 8 (starts are scarce): the table of three
             # variants, then the kernels of two of them, compiled again from this call's warm cache
             timeout 380 python benchmarks/bench_whole_step.py --models hf-llava --batch 8 --steps 20 --warmup 3 \
               --variants apollo-step-opt apollo-step-opt-mb2 apollo-accum2 --out "$OUT/micro-batches"
             TORCH_LOGS=apollo_compile timeout 170 python benchmarks/probes/step_kernels.py --models hf-llava --batch 8 \
               --steps 5 --warmup 3 --top 12 --variants apollo-step-opt apollo-step-opt-mb2 --out "$OUT/micro-batch-kernels" \
               > "$OUT/micro_batch_kernels.txt" 2>&1
             status=$?; grep -E "^--- |^\| |lanes|chose|candidate" "$OUT/micro_batch_kernels.txt" | cut -c1-300 | tail -c 7000
             exit $status ;;
  micro-batch-kernels)  # why micro-batches win or lose: each variant's kernels per step, and its timeline (span,
             # busy, summed kernel time, busiest stream: how much the chains overlap), probes/step_kernels.py; batch $2
             TORCH_LOGS=apollo_compile timeout 500 python benchmarks/probes/step_kernels.py --models hf-llava --batch "${2:-8}" --steps 5 --warmup 3 \
               --variants ${VARIANTS:-apollo-step-opt apollo-step-opt-mb2} --out "$OUT/micro-batch-kernels" \
               > "$OUT/micro_batch_kernels.txt" 2>&1
             status=$?; grep -E "^--- |^\| |lanes|chose|candidate" "$OUT/micro_batch_kernels.txt" | cut -c1-400 | tail -c 11000
             bash benchmarks/device_cache.sh save; exit $status ;;
  memory)    # the memory table at batch 64: whole-run peak against eager fp32, time against apollo's fastest
             timeout 520 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 10 --variants eager-fp32 \
               eager-bf16 eager-bf16-ckpt inductor-budget-0.5 apollo-bf16 apollo-bf16-budget-0.5 \
               apollo-bf16-budget-0.05 --out "$OUT/memory" ;;
  offload)   # offloading's step time at batch 64: apollo with and without it, eager checkpointing + save_on_cpu
             timeout 300 python benchmarks/bench_memory.py --batch 64 --skip-search --steps 5 --variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05 apollo-bf16-budget-0.05-offload --out "$OUT/offload" ;;
  edge-budget)  # the 20 GiB edge of a budget alone (RESULTS.md: apollo [1216, 1280), eager checkpointing [1152, 1216))
             timeout 520 python benchmarks/bench_memory.py --batch --search-at 1152 1216 1280 --search-probes 3 \
               --variants eager-bf16-ckpt apollo-bf16-budget-0.05 \
               --search-variants eager-bf16-ckpt apollo-bf16-budget-0.05 --out "$OUT/edge-budget" ;;
  edge-offload)  # the 20 GiB edge with offloading, default allocator (apollo [2176, 2304), eager + save_on_cpu [2048, 2176))
             timeout 520 python benchmarks/bench_memory.py --batch --search-at 2176 2304 --search-probes 2 \
               --variants eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --search-variants \
               eager-bf16-ckpt-offload apollo-bf16-budget-0.05-offload --out "$OUT/edge-offload" ;;
  edge-offload-x)  # ... with expandable segments (apollo [2496, 2560), eager + save_on_cpu [2432, 2496))
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 520 python benchmarks/bench_memory.py --batch \
               --search-at 2496 2560 --search-probes 2 --variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --search-variants eager-bf16-ckpt-offload \
               apollo-bf16-budget-0.05-offload --out "$OUT/edge-offload-x" ;;
  large-batch)  # the largest batch HF CLIP trains under each cap, a fresh process per try (bench_large_batch.py); results
             # are written after every try, so a call the guard stops keeps the tries it finished
             timeout "${GUARD:-520}" python benchmarks/bench_large_batch.py --models hf-clip --cap-gib ${CAPS:-20 40} \
               ${VARIANTS:+--variants $VARIANTS} --start "${START:-64}" ${AT:+--at $AT} --out "$OUT/large-batch" ;;
  profile)   timeout 520 python benchmarks/profile_step.py --batch 8 32 --compare inductor-ro apollo-1lane --out "$OUT/prof"
             status=$?
             rm -f "$OUT"/prof/trace_b32.json  # keep batch 8's trace: 8 returned files, 3 go to the cache
             bash benchmarks/device_cache.sh save; exit $status ;;
  host)      # where a batch-8 step's host time goes, around each launch and back to back (garbage collections,
             # cProfile's top functions)
             timeout 450 python benchmarks/probes/host_split.py --batch 8 --variants inductor-ro apollo --steps 30 \
               --b2b-profile > "$OUT/host.txt" 2>&1
             status=$?; tail -c 6000 "$OUT/host.txt"; exit $status ;;
  step-host) # where compile_step's host time goes before its replay, against reduce-overhead's whole step; each variant
             # compiles (the optimizer-inside step ~260 s cold, ~60 s from the cache) and warms up: 190 s is too short
             timeout 520 python benchmarks/probes/step_host.py --models hf-clip --batch 8 \
               --variants apollo-step-opt inductor-ro-step apollo-step --out "$OUT/step-host" > "$OUT/step_host.txt" 2>&1
             status=$?; grep -E "^--- |^\| |ncalls|[0-9] \{|\.py:[0-9]+\(" "$OUT/step_host.txt" | tail -c 9000; exit $status ;;
  step-memory)  # the whole step's peak by allocating line and pool, reduce-overhead's whole step first (history recording slows
             # the compiles: in 280 s only apollo's row finished)
             timeout 520 python benchmarks/probes/whole_step_memory.py --model hf-clip --batch 8 --steps 3 \
               --variants inductor-ro-step apollo-step-opt --out "$OUT/step-memory" > "$OUT/step_memory.txt" 2>&1
             status=$?; grep -E "^######## |^== step|by file|GiB x" "$OUT/step_memory.txt" | tail -c 9000; exit $status ;;
  budget-lanes-memory)  # what lanes hold under a budget: compile_step with memory_budget=0.5 at batch 128, one lane
             # (what the budget's bound replays) against its lanes forced, each pool by stream and what set its peak
             timeout 520 python benchmarks/probes/whole_step_memory.py --model hf-clip --batch "${2:-128}" --steps 3 \
               --variants apollo-step-opt-budget apollo-step-opt-budget-lanes --out "$OUT/budget-lanes-memory" \
               > "$OUT/budget_lanes_memory.txt" 2>&1
             status=$?; grep -E "^######## |^== step|by file|by stream|GiB x" "$OUT/budget_lanes_memory.txt" | tail -c 9000; exit $status ;;
  distributed)  # DDP on 2 GPUs: apollo as one graph (optimize_ddp off) against DDP + Inductor and against each GPU
             # training alone (scaling 1.0 = perfect), per-GPU batch 32 and 128
             timeout 520 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 128 --steps 20 --warmup 3 \
               --variants single-apollo ddp-inductor ddp-apollo-1graph --out "$OUT/distributed" > "$OUT/distributed.log" 2>&1
             status=$?; grep -E "^\| |\] (compile|numerics)|FAILED|OOM|Error" "$OUT/distributed.log" | tail -c 6000
             exit $status ;;
  placement)  # the towers on two GPUs (place_modalities) against DDP and one GPU at global batch 64
             timeout 400 torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --batch 32 --steps 20 --warmup 3 \
               --variants ddp-apollo-1graph onegpu-apollo placed-apollo --out "$OUT/placement" > "$OUT/placement.log" 2>&1
             status=$?; grep -E "^\| |\] (global|numerics)|FAILED|OOM|Error" "$OUT/placement.log" | tail -c 5000
             exit $status ;;
  *) echo "usage: $0 smoke|step|whole-step MODEL [BATCH...]|module MODEL [BATCH...]|module-memory MODEL [BATCH]|regional MODEL [BATCH...]|first-step-pool|first-step-pool-interleaved [siglip]|llava|micro-batches [BATCH...]|micro-batch-kernels [BATCH]|micro-batches-and-kernels|memory|offload|edge-budget|edge-offload|edge-offload-x|large-batch|profile|host|step-host|step-memory|distributed|placement" >&2
     exit 2 ;;
esac
status=$?
bash benchmarks/device_cache.sh save
exit $status
