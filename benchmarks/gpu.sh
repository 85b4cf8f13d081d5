#!/usr/bin/env bash
# The device check, one short run on a machine with a GPU. A session's device time is 15
# minutes, the machine's start included, so the stages run with what is least known first
# (2026-12-04 on an H200: estimate about 65 s, gpu_check 90 s and all exact, lora_memory
# 80 s without Liger and Unsloth):
#   1. gpu_estimate.py: `actdesign estimate`'s activation peak and saved bytes for the built-in
#      llama at 4 x 1024 in bf16 autocast against one real step's on the GPU, per policy (none,
#      checkpointing, llm, llm+actnn2, fewbit3+msnorm, actnn2);
#   2. lora_memory.py: LoRA through PEFT on a 1B-class LLaMA at 1 x 4096 tokens, bf16 weights:
#      PEFT, PEFT + checkpointing, ours, Liger and Unsloth when installed (goal: peak <= 0.5x
#      PEFT's at a step time no slower), with the memory each row finds still held;
#   3. runtime.py: few-bit kernels (GELU, 1-4 and 8 bits, bf16/fp32/fp16, 2^16..2^27) as a
#      share of the copy bandwidth, the small-tensor cost per call, MS norms against torch's,
#      MS-GLU, the rotation and the fused loss against eager (and Liger's loss, if installed);
#   4. llm_memory.py: peak and step time of llama, gpt2 and qwen2 at 16 x 1024 tokens in bf16
#      autocast: baseline, checkpointing, our presets, Liger-Kernel when installed; and what
#      is allocated at each setup's peak (why ours + checkpointing peaked above checkpointing);
#   6. gpu_plan.py: `plan` for the 1B-class LLaMA at 1 x 4096 under a budget of 0.35 of its
#      saved bytes; the planned model's real peak against the budget and its step time against
#      the lossless policy's times --max-slowdown (1.10).
#   5. gpu_check.py: every kernel against the CPU reference (bit for bit, or against float64),
#      the single block's peak and what is allocated at it, GPT-2 and LLaMA profiles with the
#      cost of actnn2 on the step.
# Each stage has its own time limit, so one slow stage cannot hide the others' results; where
# one command may run 10 minutes at most, run the stages in two calls.
# Usage, from the repository root:
#   bash benchmarks/gpu.sh [OUTDIR [STAGES]]   (OUTDIR: $OUT or out; STAGES: comma-separated,
#                                               default plan,estimate,lora_memory,
#                                               runtime,llm_memory,gpu_check)
set -u
out=${1:-${OUT:-out}}
stages=,${2:-plan,estimate,lora_memory,runtime,llm_memory,gpu_check},
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
stage plan 240 python benchmarks/gpu_plan.py --device cuda --budget 0.35
stage estimate 120 python benchmarks/gpu_estimate.py --device cuda --markdown
# The device may lack PEFT and cannot download: carry their wheels in $WHEELS (default wheels/,
# made here by `pip download --no-deps -d wheels peft accelerate`).
if [[ $stages == *,lora_memory,* ]] && ! python -c "import peft" 2>/dev/null; then
    python -m pip install --quiet --no-deps --no-index --find-links "${WHEELS:-wheels}" \
        peft accelerate || echo "== lora_memory: peft is not installed and no wheel was carried"
fi
stage lora_memory 200 python benchmarks/lora_memory.py --device cuda --model llama-1b --seq 4096 \
    --rows peft peft+checkpointing llm llm+checkpointing llm+actnn2 liger unsloth --skip-full \
    --repeats 5 --markdown
stage runtime 210 python benchmarks/runtime.py --device cuda --acts gelu --markdown
stage llm_memory 180 python benchmarks/llm_memory.py --device cuda --batch 16 --seq 1024 --at-peak \
    --repeats 5 --markdown
stage gpu_check 240 python benchmarks/gpu_check.py --device cuda
exit $status
