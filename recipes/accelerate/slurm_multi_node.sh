#!/bin/bash
# SLURM: 2 nodes x 8 GPUs, one `accelerate launch` per node (it starts 8 processes there).
#   sbatch recipes/accelerate/slurm_multi_node.sh [recipe overrides, e.g. training.max_steps=100]
# global batch = micro x accumulation x (nodes x GPUs per node), from the recipe config; with llama3_8b_lora.yaml
#   effective batch 64 = 4 per device x 1 accumulation x 16 processes (2 nodes x 8)
# which the script prints (hf-accum plan) before starting anything, and stops if it does not divide.
#
# Preemption and time limits: 120 s before the time limit (or when the job is preempted with a
# signal) SLURM sends SIGUSR1 to this script; it forwards the signal to the training processes, which
# finish the update in progress, write checkpoint-<update> into training.output_dir, and exit with code 75
# (hf_accum.control.EXIT_PREEMPTED). The script then requeues the job; the requeued job runs the same
# command, and training.resume_from_checkpoint=true continues from the newest checkpoint that verifies
# (or starts afresh when there is none yet).
# 120 s must cover one update plus one checkpoint write: raise it for full fine-tuning (the optimizer
# state of an 8B model is ~100 GB).
#
# The requeue is decided on the run's files, not on srun's exit code: accelerate launch and torchrun report
# any failing worker -- the 75 of a preemption included -- as 1 (docs/runs.md). So: a finished run
# (metrics.json) is never requeued; a job told to stop is requeued; a job that failed on its own is requeued
# only when it wrote a new complete checkpoint (progress was made: a crash that repeats cannot loop).
#SBATCH --job-name=hf_accum_llama3_lora
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=12:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=8
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
MASTER_PORT=29500
CONFIG=${CONFIG:-recipes/configs/llama3_8b_lora.yaml}

# The batch arithmetic of this job, from the config and the overrides the recipe will get.
hf-accum plan --config "$CONFIG" --nodes "$SLURM_NNODES" --gpus-per-node "$GPUS_PER_NODE" "$@"

# Where the run writes (as the recipe resolves it), and the moment this job started: checkpoints written
# by this job are the complete ones (hf_accum_plan.json) newer than JOB_START.
OUTPUT_DIR=$(python3 - "$CONFIG" "$@" <<'PY'
import os, sys
from hf_accum.recipe import config as C
path, overrides = C.parse_overrides(["--config", *sys.argv[1:]])
name = os.path.splitext(os.path.basename(path))[0]
print(C.load_config(path, overrides).training.get("output_dir") or os.path.join("outputs", name))
PY
)
JOB_START=$(mktemp)

PREEMPTED=0
on_usr1() {
    echo "SIGUSR1 (time limit or preemption): asking the training processes to checkpoint and stop"
    PREEMPTED=1
    # Signals the processes of the job's steps (by default not this batch script): the launchers ignore
    # SIGUSR1 (below), the training processes catch it.
    scancel --signal=USR1 "$SLURM_JOB_ID"
}
trap on_usr1 USR1
# SLURM's SIGTERM (preemption or time limit without --signal) reaches the training processes directly.
trap 'PREEMPTED=1' TERM

# srun starts one task per node; each runs accelerate launch with its own node rank. `trap '' USR1` makes
# accelerate launch (and torchrun's agent inside it) ignore SIGUSR1 -- by default it would kill them --
# while hf_accum installs its own handler in each training process.
srun bash -c "trap '' USR1; exec accelerate launch \
    --config_file recipes/accelerate/multi_node.yaml \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MASTER_ADDR \
    --main_process_port $MASTER_PORT \
    recipes/finetune_llama.py --config $CONFIG training.resume_from_checkpoint=true $*" &
SRUN_PID=$!

# `wait` returns early when the trap runs; keep waiting until srun itself has finished.
STATUS=0
while true; do
    wait "$SRUN_PID" && STATUS=0 || STATUS=$?
    kill -0 "$SRUN_PID" 2>/dev/null || break
done

NEW_CHECKPOINT=$(find "$OUTPUT_DIR" -mindepth 2 -maxdepth 2 -path "$OUTPUT_DIR/checkpoint-*/hf_accum_plan.json" \
    -newer "$JOB_START" 2>/dev/null | sed -n 1p || true)  # no directory yet: none
LATEST=$(find "$OUTPUT_DIR" -mindepth 2 -maxdepth 2 -path "$OUTPUT_DIR/checkpoint-*/hf_accum_plan.json" 2>/dev/null \
    | sed 's|/hf_accum_plan.json$||; s|.*checkpoint-||' | sort -n | tail -n 1 || true)
rm -f "$JOB_START"
if [ -f "$OUTPUT_DIR/metrics.json" ]; then
    exit "$STATUS"  # finished
fi
if [ "$PREEMPTED" = 1 ] || { [ "$STATUS" != 0 ] && [ -n "$NEW_CHECKPOINT" ]; }; then
    RESUMES="no checkpoint: it starts afresh"
    [ -n "$LATEST" ] && RESUMES="$OUTPUT_DIR/checkpoint-$LATEST"
    echo "requeueing job $SLURM_JOB_ID (srun exited with $STATUS; the run resumes from $RESUMES)"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$STATUS"
