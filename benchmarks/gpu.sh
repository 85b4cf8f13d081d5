#!/usr/bin/env bash
# The device check, short runs on a machine with a GPU. A session's device time is 15 minutes,
# the machine's start included, and one command runs 10 minutes at most: name the stages a
# call runs (each has its own time limit, so one slow stage cannot hide the others' results).
#
# Speed (each stage under 8 minutes, its table printed last):
#   speed: benchmarks/step_profile.py, a training step's launches, host and device time by
#      op family: the built-in llama and qwen2 at 16 x 1024 and the 1B LLaMA at 4 x 4096 in
#      bf16 autocast (eager, llm, llm+checkpointing, checkpointing, Liger-Kernel), llama's
#      llm+actnn2, and LoRA r=16 on the 1B LLaMA at 1 x 4096 (PEFT, llm); then
#      benchmarks/speed_goals.py's table of the goals;
#   kernels: benchmarks/runtime.py --quick: every kernel as a share of the copy bandwidth
#      (bf16, 2^24 elements) and each op's host cost per call against torch's;
#   compiled: torch.compile(model) step times, eager against llm (and Liger), llama at
#      16 x 1024 and the 1B LLaMA at 4 x 4096;
#   costs: benchmarks/gpu_costs.py measures the card's costs for the planner (written to
#      OUTDIR and installed into runtime/memory/cards/: commit the file), then gpu_plan.py plans
#      the 1B LLaMA with them and sets the predicted step time beside the measured one;
#   margins: benchmarks/gpu_margins.py measures the card's memory margins for `estimate`
#      (the CUDA context, the allocator's fragmentation per policy family; merged into the
#      same card file), then runs a real step where the estimate fits with little to spare.
# Vision (each under 8 minutes; timm is carried as a wheel like Liger-Kernel and PEFT):
#   vision: benchmarks/gpu_vision.py, ResNet-50 at 64 x 224² in bf16 autocast, channels_last:
#      step time and max_memory_allocated for eager, torch.compile, timm's checkpointing, cnn,
#      actnn2 and cnn+actnn2, and the estimate's peak beside the measured one;
#   vision_batch: the largest batch each preset fits on the card by the estimate, and one
#      real step at it.
# Long sequences (under 8 minutes; run it alone):
#   long: benchmarks/gpu_long.py, the host link's copy rate, then LoRA r=16 on the
#      Llama-3.1-8B config at 32K, 64K and 128K tokens with llm+tiled+offload and with
#      llm+tiled+checkpoint: max_memory_allocated against the estimate's total, step times,
#      and offload's step over the step without it.
# Memory and exactness (2026-12-04 on an H200: estimate about 65 s, gpu_check 90 s, lora_memory
# 80 s without Liger and Unsloth):
#   estimate: `actdesign estimate`'s activation peak and saved bytes for the built-in llama at
#      4 x 1024 in bf16 autocast against one real step's on the GPU, per policy;
#   lora_memory: LoRA through PEFT on the 1B LLaMA at 1 x 4096 tokens, bf16 weights, every
#      row in a fresh process: PEFT, PEFT + checkpointing, ours, Liger and Unsloth when
#      installed;
#   runtime: benchmarks/runtime.py, the whole kernel benchmark;
#   llm_memory: peak and step time of llama, gpt2 and qwen2 at 16 x 1024 in bf16 autocast,
#      with what is allocated at each setup's peak;
#   plan: `plan` for the 1B LLaMA at 1 x 4096 under a budget of 0.35 of its saved bytes;
#   gpu_check: every kernel against the CPU reference, and the step cost of actnn2.
# Liger-Kernel and PEFT are carried as wheels in $WHEELS (default wheels/, made here by
# `pip download --no-deps -d wheels liger-kernel peft accelerate timm`); the device cannot
# download.
# Usage, from the repository root:
#   bash benchmarks/gpu.sh [OUTDIR [STAGES]]   (OUTDIR: $OUT or out; STAGES: comma-separated,
#                                               default speed)
set -u
out=${1:-${OUT:-out}}
stages=,${2:-speed},
mkdir -p "$out"
# The device's Python may lack platformdirs (installed --no-deps): name the ops cache outright.
export ACTDESIGN_CACHE_DIR=${ACTDESIGN_CACHE_DIR:-/tmp/actdesign-cache}
python -m pip install --quiet --no-deps --no-build-isolation . || exit 2
status=0
stage() {  # stage NAME SECONDS COMMAND...: output to OUTDIR/NAME.txt and to the console
    local name=$1 limit=$2
    shift 2
    [[ $stages == *,$name,* ]] || return 0
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; status=1; }
}
# The device may lack Liger-Kernel or PEFT and cannot download: carried wheels install.
for package in liger_kernel peft timm; do
    python -c "import $package" 2>/dev/null || python -m pip install --quiet --no-deps \
        --no-index --find-links "${WHEELS:-wheels}" "${package/_/-}" accelerate 2>/dev/null \
        || echo "== $package is not installed and no wheel was carried"
done
card=$(python -c "import torch; n = torch.cuda.get_device_name(0).lower(); \
print(next((c for c in ('h200', 'h100', 'a100', 'l40s', 'rtx4090') if c in n.replace(' ', '')), 'h200'))")
profile() {  # profile NAME SECONDS ARGS...: a step profile, JSON to OUTDIR/NAME.json
    local name=$1 limit=$2
    shift 2
    stage "$name" "$limit" python benchmarks/step_profile.py --device cuda --repeats 5 \
        --markdown --json "$out/$name.json" "$@"
}
if [[ $stages == *,speed,* ]]; then
    rm -f "$out"/speed_*.json
    stages="$stages,speed_llama,speed_qwen2,speed_llama1b,speed_lora,"
    profile speed_llama 110 --model llama --batch 16 --seq 1024 \
        --policy eager llm llm+checkpointing checkpointing liger llm+actnn2
    profile speed_qwen2 90 --model qwen2 --batch 16 --seq 1024 \
        --policy eager llm llm+checkpointing checkpointing liger
    profile speed_llama1b 130 --model llama-1b --batch 4 --seq 4096 --no-count \
        --policy eager llm llm+checkpointing checkpointing liger
    profile speed_lora 70 --model llama-1b --batch 1 --seq 4096 --lora 16 --no-count \
        --policy peft llm
    stage speed_goals 20 python benchmarks/speed_goals.py --markdown "$out"/speed_*.json
fi
stage kernels 200 python benchmarks/runtime.py --device cuda --quick --acts gelu --markdown
if [[ $stages == *,compiled,* ]]; then
    stages="$stages,compiled_llama,compiled_llama1b,"
    profile compiled_llama 240 --compile --model llama --batch 16 --seq 1024 \
        --policy eager llm liger
    profile compiled_llama1b 200 --compile --model llama-1b --batch 4 --seq 4096 \
        --policy eager llm
fi
if [[ $stages == *,costs,* ]]; then
    stages="$stages,gpu_costs,costs_plan,"
    stage gpu_costs 150 python benchmarks/gpu_costs.py --card "$card" --install \
        --out "$out/$card.json"
    python -m pip install --quiet --no-deps --no-build-isolation . || exit 2
    stage costs_plan 240 python benchmarks/gpu_plan.py --device cuda --budget 0.35 \
        --card "$card"
fi
stage margins 300 python benchmarks/gpu_margins.py --card "$card" --install \
    --out "$out/${card}_margins.json"
stage plan 240 python benchmarks/gpu_plan.py --device cuda --budget 0.35 --card "$card"
stage estimate 120 python benchmarks/gpu_estimate.py --device cuda --markdown
stage lora_memory 200 python benchmarks/lora_memory.py --device cuda --model llama-1b --seq 4096 \
    --rows peft peft+checkpointing llm llm+checkpointing llm+actnn2 liger unsloth --skip-full \
    --repeats 5 --markdown
stage runtime 210 python benchmarks/runtime.py --device cuda --acts gelu --markdown
stage llm_memory 180 python benchmarks/llm_memory.py --device cuda --batch 16 --seq 1024 --at-peak \
    --repeats 5 --markdown
stage gpu_check 240 python benchmarks/gpu_check.py --device cuda
stage vision 420 python benchmarks/gpu_vision.py --device cuda --repeats 5 --markdown
stage vision_batch 420 python benchmarks/gpu_vision.py --device cuda --max-batch --markdown
stage long 470 python benchmarks/gpu_long.py --device cuda --seconds 330 --markdown
exit $status
