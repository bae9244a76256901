#!/usr/bin/env bash
# The GPU list: what a CPU cannot check, run in one go on a box with one NVIDIA GPU.
#   bash labs/gpu_reference.sh OUTDIR [SECONDS] [PARTS]
# From the repository root. OUTDIR gets log.txt (everything printed), results/<lab>/*.jsonl (the labs' results
# files, with their hardware fingerprints; copy the ones worth keeping into labs/results/reference/) and the
# profiler traces beside them, and results.tgz (all of results/, traces gzip-compressed).
# SECONDS (default 420) bounds the whole run: each step gets what is left of it, in the order below.
# PARTS (default "tests lab07 gpt2 profile") picks which of the four to run.
#
# 1. the CUDA-marked tests (every lab at a world of one with nccl and with 2 ranks sharing the GPU through gloo,
#    DDP/DistAdamW/DistMuon equal to torch on CUDA tensors, bf16, steps under set_sync_debug_mode("error"), the
#    global norm of CUDA DTensor gradients);
# lab07: Lab 7's triage of every fault with the ranks sharing the GPU through gloo (in the background, beside
#    the tests: it times nothing; its log is lab07.txt);
# 2. the 124 M `gpt2` preset (context 1024, micro-batch 8, bf16 autocast) at a world of one with nccl:
#    lab03 (tokens/s, MFU, nanodist DDP / torch DDP), lab04 (DistAdamW / DDP + fused AdamW, DistMuon / torch
#    Muon), lab05 (peak memory: nanodist's accounting beside torch.cuda.max_memory_allocated), lab03 --compile
#    (nanodist DDP beside compiled plain torch, --baseline, in one launch: the MFU to reach; then torch DDP);
# 3. --profile: one step of DDP (nanodist's and torch's), ZeRO-2 (DistAdamW) and FSDP (nanodist's and FSDP2)
#    traced with torch.profiler: the gpt2 preset at a world of one with nccl (compute only), and the small
#    preset on 2 ranks sharing the GPU through gloo (communication through the host).
set -u
OUTDIR=${1:?usage: bash labs/gpu_reference.sh OUTDIR [SECONDS] [PARTS]}
DEADLINE=$(( $(date +%s) + ${2:-420} ))
PARTS=" ${3:-tests lab07 gpt2 profile} "
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR/results"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

step() {  # step MAX_SECONDS COMMAND...: run it with what is left of the deadline (at most MAX_SECONDS)
    local max=$1 left=$(( DEADLINE - $(date +%s) ))
    shift
    (( left > max )) && left=$max
    if (( left < 20 )); then echo "=== skipped (out of time): $*"; return; fi
    echo "=== $(date +%T) [${left}s] $*"
    timeout -k 5 "$left" "$@" 2>&1
    echo "=== rc=$? $(date +%T)"
}

GPT2=(--model gpt2 --seq-len 1024 --micro-batch 8 --dtype bf16 --no-progress)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1)
{
    nvidia-smi -L
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    export NANODIST_RESULTS_DIR="$OUTDIR/results"
    if [[ $PARTS == *" lab07 "* ]]; then
        (step 170 env NANODIST_BACKEND=gloo NANODIST_DEVICE=cuda "$PY" labs/lab07_debug.py --fault all \
            > "$OUTDIR/lab07.txt" 2>&1) &
    fi
    if [[ $PARTS == *" tests "* ]]; then
        step 170 "$PY" -m pytest -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_ddp.py \
            tests/test_grad_norm.py -n 4 -q -rfEs
    fi
    wait  # Lab 7, before anything is timed
    if [[ $PARTS == *" gpt2 "* ]]; then
        step 60 "${TORCHRUN[@]}" labs/lab03_ddp.py "${GPT2[@]}" --steps 20
        step 60 "${TORCHRUN[@]}" labs/lab04_zero.py "${GPT2[@]}" --steps 12
        step 200 "${TORCHRUN[@]}" labs/lab03_ddp.py "${GPT2[@]}" --steps 20 --compile --impl nanodist --baseline
        step 60 "${TORCHRUN[@]}" labs/lab05_fsdp.py "${GPT2[@]}" --steps 8
        step 200 "${TORCHRUN[@]}" labs/lab03_ddp.py "${GPT2[@]}" --steps 20 --compile --impl torch
    fi
    if [[ $PARTS == *" profile "* ]]; then
        step 90 "${TORCHRUN[@]}" labs/lab03_ddp.py "${GPT2[@]}" --steps 8 --impl all --profile
        SMALL=(--model small --no-progress --profile)
        TWO=(env NANODIST_BACKEND=gloo NANODIST_DEVICE=cuda "$PY" -m torch.distributed.run --standalone --nproc_per_node=2)
        step 90 "${TWO[@]}" labs/lab03_ddp.py "${SMALL[@]}" --steps 10 --impl all
        step 90 "${TWO[@]}" labs/lab04_zero.py "${SMALL[@]}" --steps 8 --opt dist-adamw ddp-adamw
        step 90 "${TWO[@]}" labs/lab05_fsdp.py "${SMALL[@]}" --steps 8 --impl all
    fi
} 2>&1 | tee "$OUTDIR/log.txt"
find "$OUTDIR/results" -name '*.trace.json' -exec gzip -9 {} +
tar czf "$OUTDIR/results.tgz" -C "$OUTDIR" results
