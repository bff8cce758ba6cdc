#!/bin/bash
# Resources. Edit here or override at submission (sbatch --nodes=4 --time=12:00:00 scripts/slurm_submit.sh ...).
# Comments must stay on their own lines: sbatch reads only whole "#SBATCH" lines, up to the first command.
#SBATCH --job-name=fsdp-train
#SBATCH --nodes=2
# One task per node: that task is torchrun, which starts one training process per GPU itself.
#SBATCH --ntasks-per-node=1
# Sites that use generic resources instead: --gres=gpu:8
#SBATCH --gpus-per-node=8
# All cores of the node for the one task: OMP threads and DataLoader workers of 8 ranks.
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
# SIGUSR1 to this batch shell (B:) 300 s before the time limit; the trap below turns it into a checkpoint.
#SBATCH --signal=B:USR1@300
# Requeueable: Slurm requeues on node failure and preemption, and this script requeues itself at the time limit.
#SBATCH --requeue
# A requeued job keeps its id, so it writes to the same log file: append instead of overwriting.
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
##SBATCH --partition=gpu
##SBATCH --account=my_account
#
# Multi-node fsdp_train.py under Slurm: srun starts scripts/multinode_launch.sh (and through it one torchrun)
# on every node, rendezvous on the first node of the allocation.
#
#   EXPERIMENT=llama1b-sft DATASET=hf_datasets/my_corpus CONFIG=configs/llama3.2_1b.yaml TOTAL_BATCH_SIZE=128 \
#       sbatch scripts/slurm_submit.sh --lr 1e-5          # arguments go to fsdp_train.py
#
#   # check the arithmetic and the commands on the login node first (prints them, starts nothing):
#   DRY_RUN=1 SLURM_JOB_ID=1 SLURM_JOB_NODELIST='gpu[01-02]' SLURM_NNODES=2 GPUS_PER_NODE=8 \
#       EXPERIMENT=llama1b-sft DATASET=hf_datasets/my_corpus CONFIG=configs/llama3.2_1b.yaml TOTAL_BATCH_SIZE=128 \
#       bash scripts/slurm_submit.sh
#
# Run sbatch from the repository root: the job runs there (relative paths start there) and finds
# scripts/multinode_launch.sh and fsdp_train.py there (or set REPO_DIR). sbatch passes your environment on, so
# set the variables on the sbatch command line or export them before:
#   EXPERIMENT, DATASET, MODEL, CONFIG   -e, -d, -m, --config for fsdp_train.py (or give the flags as arguments)
#   TOTAL_BATCH_SIZE   sequences per optimizer step over all GPUs; --grad-accum-steps is derived as
#                      TOTAL_BATCH_SIZE / (MICRO_BATCH_SIZE x nodes x GPUS_PER_NODE / the --context-parallel
#                      degree), an error unless whole and >= 1
#   MICRO_BATCH_SIZE   --batch-size, sequences per GPU per forward (default: batch-size in CONFIG)
#   GPUS_PER_NODE      training processes per node (default: SLURM_GPUS_ON_NODE, set by --gpus-per-node)
#   MASTER_PORT        rendezvous port on the first node (default 29500 + job id % 1000, so that two jobs sharing
#                      a node do not collide)
#   PYTHON             interpreter with torch (default: the repository's .venv/bin/python, else python3)
#   REQUEUE_ON_TIMEOUT 1 (default): requeue the job after the checkpoint taken at the time limit; 0: just stop
#   MAX_REQUEUES       stop requeueing after this many restarts (default 20; SLURM_RESTART_COUNT counts them)
#   MAX_RESTARTS       torchrun --max-restarts on every node (default 2): a training process that dies (crash,
#                      kill -9, OOM kill) makes torchrun restart the group, which resumes from the newest intact
#                      checkpoint without a new job
#   DRY_RUN=1          print the srun command and the torchrun command each node would run, then exit
# scripts/multinode_launch.sh sets the runtime environment of every node: HF_HUB_OFFLINE=1 (and the other
# offline switches), OMP_NUM_THREADS = the task's cores / GPUs, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, NCCL_DEBUG=WARN;
# see its export_runtime_env for NCCL_SOCKET_IFNAME and the rest. Values you export win.
# HF_HOME (the model cache) and the dataset must be on a filesystem every node can read.
#
# How the job stops before its time limit without losing work
#   1. At time limit - 300 s Slurm sends SIGUSR1 to this batch shell only (--signal=B:USR1@300).
#   2. The trap sends SIGUSR1 to srun, which forwards it to its tasks: multinode_launch.sh on every node.
#   3. multinode_launch.sh sends SIGTERM to the training processes (torchrun's children), not to torchrun.
#      fsdp_train.py finishes its step, saves a checkpoint, exits 0; torchrun then exits 0, and so does srun.
#   4. This script runs `scontrol requeue $SLURM_JOB_ID`. The job goes back to the queue with the same id and,
#      when it starts again, runs this same script with the same environment and arguments: same EXPERIMENT, so
#      fsdp_train.py finds outputs/<experiment> and resumes from its latest complete checkpoint.
# Why not the simpler variants:
#   * `trap ... ; kill -TERM $srun_pid`: srun answers SIGTERM by SIGKILLing its tasks (Slurm src/srun, "forcing
#     job termination"), so the trainers die mid-step and nothing is saved.
#   * --signal=TERM@300 (no B:): Slurm signals every process of the step, torchrun included. torchrun forwards
#     SIGTERM and then SIGKILLs the ranks after 30 s (torch < 2.12; TORCH_ELASTIC_SHUTDOWN_TIMEOUT on newer),
#     which cuts off a large checkpoint, and exits 1 even after a clean save; and this shell would never learn
#     that the time limit came, so it could not requeue.
#   * A dedicated signal (USR1, not TERM) tells "time limit, save and come back" apart from scancel or
#     preemption, which send SIGTERM: those must not requeue from here. (With --requeue, Slurm itself requeues
#     a preempted job; scancel means stop.) On SIGTERM every process of the job gets it directly: the ranks save
#     within torchrun's grace period and Slurm's KillWait / preemption GraceTime, then Slurm SIGKILLs.
# Slurm may send the signal up to 60 s early. 300 s covers finishing the current optimizer step plus writing the
# checkpoint; measure your save time in the trainer log and raise it for large models on slow filesystems
# (sbatch --signal=B:USR1@600 ...).
set -euo pipefail

# sbatch runs a copy of this file from its spool directory, so find the repository from the submit directory.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
launcher=$REPO_DIR/scripts/multinode_launch.sh
if [[ ! -f $launcher ]]; then
  echo "error: $launcher not found; run sbatch from the repository root or set REPO_DIR" >&2
  exit 2
fi
# One copy of the launch logic: log, die, prepare_launch, wait_for_exit, print_command.
# shellcheck source=scripts/multinode_launch.sh
source "$launcher"

srun_pid=
stop_reason=

on_time_limit() {
  signal_arrived=1
  stop_reason=time-limit
  log "time limit is near (SIGUSR1): asking every node to save a checkpoint and stop"
  # srun forwards SIGUSR1 to its tasks as is; SIGTERM it would turn into SIGKILL.
  if [[ -n $srun_pid ]]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
}

on_terminate() {
  signal_arrived=1
  log "got SIGTERM (scancel, preemption or the time limit itself): Slurm signals the training step directly;" \
    "waiting for it to exit"
}

requeue_after_time_limit() {
  local restarts=${SLURM_RESTART_COUNT:-0} max=${MAX_REQUEUES:-20}
  if [[ ${REQUEUE_ON_TIMEOUT:-1} != 1 ]]; then
    log "REQUEUE_ON_TIMEOUT=${REQUEUE_ON_TIMEOUT}: not requeueing; submit the same command again to resume"
  elif ((restarts >= max)); then
    log "already restarted $restarts times (MAX_REQUEUES=$max): not requeueing; submit again to resume"
  else
    log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most $max); it resumes from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID" ||
      log "scontrol requeue failed (is the job requeueable? #SBATCH --requeue); submit the same command to resume"
  fi
}

slurm_main() {
  local var
  for var in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES; do
    [[ -n ${!var:-} ]] || die "$var is not set: this script runs inside a Slurm job" \
      "(sbatch scripts/slurm_submit.sh ...); without Slurm use scripts/multinode_launch.sh"
  done
  local nodes
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#nodes[@]} > 0)) || die "scontrol show hostnames '$SLURM_JOB_NODELIST' listed no host"

  # What multinode_launch.sh needs on every node: c10d rendezvous hosted by the first node of the allocation.
  # The job id as rendezvous id stays the same across requeues; the store is new each time (a new torchrun).
  export NNODES=$SLURM_NNODES MASTER_ADDR=${nodes[0]} RDZV_ID=$SLURM_JOB_ID MAX_RESTARTS=${MAX_RESTARTS:-2}
  export MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
  export NPROC_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  [[ -n $NPROC_PER_NODE ]] || die "GPUs per node unknown: set GPUS_PER_NODE, or request GPUs with --gpus-per-node"
  # Ranks come from the rendezvous; a NODE_RANK left in the submitting shell would switch every node to rank 0.
  unset NODE_RANK
  # Validate here, once, before any node starts (each node's launcher repeats it on the same environment).
  prepare_launch "$@"

  # --export=ALL: the variables above must reach the tasks even where sbatch --export=NONE is the site default.
  # --kill-on-bad-exit=0: a node that finished its final save must not SIGKILL a slower one still writing.
  local srun_cmd=(srun --export=ALL --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0)
  # Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch; without it every rank gets one core.
  if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then srun_cmd+=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
  srun_cmd+=("$launcher" "$@")

  if [[ ${DRY_RUN:-0} == 1 ]]; then
    print_command "${srun_cmd[@]}"
    print_command "${torchrun_cmd[@]}"
    return 0
  fi
  log "job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}: ${#nodes[@]} nodes (${nodes[*]}) x $NPROC_PER_NODE" \
    "= world size $world_size${grad_accum_steps:+, grad-accum-steps $grad_accum_steps};" \
    "rendezvous $MASTER_ADDR:$MASTER_PORT"
  trap on_time_limit USR1
  trap on_terminate TERM
  "${srun_cmd[@]}" &
  srun_pid=$!
  wait_for_exit "$srun_pid"
  log "srun exited with status $child_status"
  if [[ $stop_reason == time-limit ]]; then requeue_after_time_limit; fi
  return "$child_status"
}

slurm_main "$@"
