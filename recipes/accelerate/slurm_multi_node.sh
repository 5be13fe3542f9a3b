#!/bin/bash
# SLURM: 2 nodes x 8 GPUs, one `accelerate launch` per node (it starts 8 processes there).
#   sbatch recipes/accelerate/slurm_multi_node.sh
# global batch = micro x accumulation x (nodes x GPUs per node) = 4 x 1 x 16 = 64 with llama3_8b_lora.yaml
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

# srun starts one task per node; each runs accelerate launch with its own node rank.
srun bash -c "accelerate launch \
    --config_file recipes/accelerate/multi_node.yaml \
    --num_machines $SLURM_NNODES \
    --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MASTER_ADDR \
    --main_process_port $MASTER_PORT \
    recipes/finetune_llama.py --config $CONFIG $*"
