#!/bin/bash
# SLURM: 2 nodes x 8 GPUs, one `accelerate launch` per node (it starts 8 processes there).
#   sbatch recipes/accelerate/slurm_multi_node.sh [recipe overrides, e.g. training.max_steps=100]
# global batch = micro x accumulation x (nodes x GPUs per node), from the recipe config; with llama3_8b_lora.yaml
#   effective batch 64 = 4 per device x 1 accumulation x 16 processes (2 nodes x 8)
# which the script prints (hf-accum plan) before starting anything, and stops if it does not divide.
#SBATCH --job-name=hf_accum_llama3_lora
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE=8
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=29500
CONFIG=${CONFIG:-recipes/configs/llama3_8b_lora.yaml}

# The batch arithmetic of this job, from the config and the overrides the recipe will get.
hf-accum plan --config "$CONFIG" --nodes "$SLURM_NNODES" --gpus-per-node "$GPUS_PER_NODE" "$@"

# srun starts one task per node; each runs accelerate launch with its own node rank.
srun bash -c "accelerate launch \
    --config_file recipes/accelerate/multi_node.yaml \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MASTER_ADDR \
    --main_process_port $MASTER_PORT \
    recipes/finetune_llama.py --config $CONFIG $*"
