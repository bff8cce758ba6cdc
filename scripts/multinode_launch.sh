#!/usr/bin/env bash
# Launch fsdp_train.py on one node of a (multi-node) run without SLURM: start the SAME command on every node.
#
#   # 2 nodes x 8 GPUs, run on both nodes; 10.0.0.1 is one of them, reachable from the other:
#   NNODES=2 MASTER_ADDR=10.0.0.1 TOTAL_BATCH_SIZE=128 CONFIG=configs/llama3.2_1b.yaml \
#       scripts/multinode_launch.sh -e llama1b-sft -d hf_datasets/my_corpus
#
#   # print the torchrun command instead of running it
#   DRY_RUN=1 NNODES=2 MASTER_ADDR=10.0.0.1 NPROC_PER_NODE=8 scripts/multinode_launch.sh -e x -d data -m model
#
# Environment (all optional except MASTER_ADDR when NNODES > 1):
#   NNODES            number of nodes (default 1)
#   NPROC_PER_NODE    training processes (GPUs) on this node (default: the GPUs in CUDA_VISIBLE_DEVICES,
#                     else those `nvidia-smi -L` lists; set it for a CPU run)
#   MASTER_ADDR       address of one of the nodes, reachable from all of them; it hosts the rendezvous store.
#                     Unset with NNODES=1: torchrun --standalone.
#   MASTER_PORT       rendezvous TCP port on MASTER_ADDR (default 29500)
#   NODE_RANK         unset (recommended): c10d rendezvous, nodes may start in any order and get their ranks
#                     on arrival. Set to 0..NNODES-1: static rendezvous with a fixed node order; node 0 must be
#                     the machine at MASTER_ADDR.
#   RDZV_ID           c10d rendezvous id, identical on every node (default fsdp_train)
#   EXPERIMENT, DATASET, MODEL, CONFIG
#                     passed as -e, -d, -m, --config (or pass those flags as arguments instead)
#   TOTAL_BATCH_SIZE  sequences per optimizer step summed over all processes; the launcher derives
#                     --grad-accum-steps = TOTAL_BATCH_SIZE / (MICRO_BATCH_SIZE x NNODES x NPROC_PER_NODE
#                     / the --context-parallel degree) and stops with an error when that is not a whole number >= 1
#   MICRO_BATCH_SIZE  sequences per process per forward pass (--batch-size); default: batch-size in CONFIG
#   MAX_RESTARTS      torchrun --max-restarts (default 0): when a training process dies (a crash, a kill -9, an OOM
#                     kill), torchrun stops the others and starts the group again, up to this many times; the new
#                     group resumes from the newest intact checkpoint. With NNODES > 1 the script also exports
#                     TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so each restart gets a fresh store (see runtime.py).
#   PYTHON            interpreter with torch installed (default: the repository's .venv/bin/python, else python3)
#   DRY_RUN=1         print the torchrun command and exit
#   REPO_DIR          repository root holding fsdp_train.py (default: the parent of this script's folder)
# The script changes into REPO_DIR, so relative paths (dataset, CONFIG, --save-dir) are relative to it; a re-run
# of the same command therefore finds the same outputs/<experiment> and resumes from it.
# Arguments are passed to fsdp_train.py unchanged, after the derived ones. -b/--batch-size and
# --grad-accum-steps may not be given as arguments together with TOTAL_BATCH_SIZE (the total would be wrong).
#
# Stopping cleanly: send SIGUSR1 or SIGTERM to THIS script (kill -USR1 <pid>; scripts/slurm_submit.sh does it
# ahead of the time limit). It sends SIGTERM to the training processes themselves, not to torchrun: the
# trainer saves a checkpoint at the next step boundary and exits 0, torchrun sees every worker succeed and
# exits 0. Signalling torchrun instead would start its kill timer: torchrun forwards SIGTERM and SIGKILLs
# workers that are still running 30 s later (configurable only on torch >= 2.12 through
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT), which cuts off a large checkpoint mid-write, and it exits 1 even when the
# workers saved cleanly. torchrun is started with SIGUSR1 ignored so that a SIGUSR1 delivered to every process
# of a Slurm step reaches only this script. Ctrl-C also saves, but through torchrun: its 30 s limit applies
# and it exits 1 (see on_interrupt).
#
# scripts/slurm_submit.sh sources this file for its functions; `main` runs only when it is executed.
set -euo pipefail

log() { printf '[%s %s launch] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$(hostname -s 2>/dev/null || hostname)" "$*" >&2; }

die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

# Shell-quoted, so a printed command can be pasted back into a shell (and parsed by tests with shlex).
print_command() {
  local quoted
  quoted=$(printf '%q ' "$@")
  printf '%s\n' "${quoted% }"
}

require_positive_int() {
  [[ $2 =~ ^[0-9]+$ ]] && ((10#$2 > 0)) || die "$1=$2 must be a positive integer"
}

# The GPUs CUDA_VISIBLE_DEVICES leaves visible: as CUDA reads it, up to the first entry that is no device index or
# UUID ("-1" or "NoDevFiles" hide them all).
count_visible_devices() {
  local ids id count=0
  IFS=, read -ra ids <<<"$1"
  for id in "${ids[@]}"; do
    id=${id//[[:space:]]/}
    [[ $id =~ ^[0-9]+$ || $id =~ ^(GPU|MIG)- ]] || break
    count=$((count + 1))
  done
  echo "$count"
}

detect_gpus_per_node() {
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    count_visible_devices "$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# The value of one key in a YAML config (keys may use dashes or underscores), empty when absent.
config_value() {
  "$PYTHON" - "$1" "$2" <<'PY'
import sys

import yaml

path, key = sys.argv[1], sys.argv[2]
try:
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
    sys.exit(f"error: CONFIG={path} cannot be read as YAML: {' '.join(str(exc).split())}")
if not isinstance(config, dict):
    sys.exit(f"error: {path}: expected a mapping of flag names to values, got {type(config).__name__}")
value = config.get(key, config.get(key.replace("-", "_")))
print("" if value is None else value)
PY
}

# The first argument that sets the per-process batch or the accumulation, if any (argparse also accepts -b4).
find_batch_flag() {
  local arg
  for arg in "$@"; do
    case $arg in
      -b | -b?* | --batch-size | --batch-size=* | --batch_size | --batch_size=* | \
        --grad-accum-steps | --grad-accum-steps=* | --grad_accum_steps | --grad_accum_steps=*)
        echo "$arg"
        return
        ;;
      --global-batch-size | --global-batch-size=* | --global_batch_size | --global_batch_size=*)
        # beside MICRO_BATCH_SIZE alone it is the run's total (the trainer derives the accumulation)
        if [[ -n ${TOTAL_BATCH_SIZE:-} ]]; then echo "$arg" && return; fi
        ;;
    esac
  done
}

# The value of a flag in the trainer's arguments (the last one given), empty when absent.
arg_value() {
  local flag=$1 arg value="" expect=0 body alt
  shift
  body=${flag#--}
  alt="--${body//-/_}" # argparse takes --context_parallel for --context-parallel
  for arg in "$@"; do
    if ((expect)); then value=$arg expect=0 && continue; fi
    case $arg in
      "$flag" | "$alt") expect=1 ;;
      "$flag"=* | "$alt"=*) value=${arg#*=} ;;
    esac
  done
  echo "$value"
}

# The run's config file: a --config argument, else CONFIG (empty: none); one that does not exist is an error.
config_file() {
  local given config
  given=$(arg_value --config "$@")
  config=${given:-${CONFIG:-}}
  [[ -z $config || -f $config ]] || die "--config $config not found (relative paths start at the repository root $REPO_DIR)"
  echo "$config"
}

# The --context-parallel degree of the run (the arguments' last, else the config file's, else 1): the processes of
# one context group share each sequence, so the data-parallel ranks are the world over it.
context_degree() {
  local degree config name="--context-parallel"
  degree=$(arg_value --context-parallel "$@")
  config=$(config_file "$@") || exit 2
  if [[ -z $degree && -n $config ]]; then
    degree=$(config_value "$config" context-parallel) || exit 2
    name="the config $config's context-parallel"
  fi
  [[ -n $degree ]] || degree=1
  [[ $degree =~ ^[0-9]+$ ]] && ((10#$degree > 0)) || die "$name $degree must be a positive integer"
  echo "$((10#$degree))"
}

# grad_accum_steps = total / (micro x world), which must be a whole number >= 1 (the seed's arithmetic, checked).
derive_grad_accum_steps() {
  local total=$1 micro=$2 world=$3 world_desc=$4
  local per_pass=$((micro * world))
  if ((total < per_pass)); then
    die "TOTAL_BATCH_SIZE=$total is smaller than one micro-batch on every process:" \
      "MICRO_BATCH_SIZE $micro x $world_desc = $per_pass sequences;" \
      "raise TOTAL_BATCH_SIZE to $per_pass or lower MICRO_BATCH_SIZE"
  fi
  if ((total % per_pass != 0)); then
    die "TOTAL_BATCH_SIZE=$total is not divisible by MICRO_BATCH_SIZE $micro x $world_desc = $per_pass;" \
      "use a multiple of $per_pass such as $((total / per_pass * per_pass)) or $(((total / per_pass + 1) * per_pass))"
  fi
  grad_accum_steps=$((total / per_pass))
}

# Validate the environment and fill torchrun_cmd (plus nproc_per_node, world_size, grad_accum_steps).
# Changes into REPO_DIR.
prepare_launch() {
  REPO_DIR=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
  cd "$REPO_DIR" || die "REPO_DIR=$REPO_DIR is not a directory"
  [[ -f fsdp_train.py ]] || die "$REPO_DIR/fsdp_train.py not found; set REPO_DIR to the repository root"
  if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
  fi

  local nnodes=${NNODES:-1} nproc=${NPROC_PER_NODE:-} port=${MASTER_PORT:-29500}
  require_positive_int NNODES "$nnodes"
  nnodes=$((10#$nnodes))
  if [[ -z $nproc ]]; then
    nproc=$(detect_gpus_per_node)
    local why="nvidia-smi lists none"
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then why="CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides them"; fi
    [[ $nproc != 0 ]] || die "no GPUs found ($why); set NPROC_PER_NODE, e.g. NPROC_PER_NODE=2 for a CPU run"
  fi
  require_positive_int NPROC_PER_NODE "$nproc"
  nproc=$((10#$nproc))
  require_positive_int MASTER_PORT "$port"
  port=$((10#$port))
  ((port <= 65535)) || die "MASTER_PORT=$port must be a TCP port, 1 to 65535"
  nproc_per_node=$nproc
  world_size=$((nnodes * nproc))

  torchrun_cmd=("$PYTHON" -m torch.distributed.run)
  if ((nnodes == 1)) && [[ -z ${MASTER_ADDR:-} ]]; then
    torchrun_cmd+=(--standalone) # NODE_RANK, if set, can only be 0: one node needs no rendezvous address
    [[ ${NODE_RANK:-0} =~ ^0+$ ]] || die "NODE_RANK=$NODE_RANK must be between 0 and NNODES-1 (0)"
  elif [[ -n ${NODE_RANK:-} ]]; then
    [[ -n ${MASTER_ADDR:-} ]] || die "NODE_RANK=$NODE_RANK (static rendezvous) needs MASTER_ADDR, the address of node 0"
    if ! [[ $NODE_RANK =~ ^[0-9]+$ ]] || ((10#$NODE_RANK >= nnodes)); then
      die "NODE_RANK=$NODE_RANK must be between 0 and NNODES-1 ($((nnodes - 1)))"
    fi
    torchrun_cmd+=(--nnodes "$nnodes" --node-rank "$((10#$NODE_RANK))" --master-addr "$MASTER_ADDR"
      --master-port "$port")
  elif [[ -n ${MASTER_ADDR:-} ]]; then
    torchrun_cmd+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$port"
      --rdzv-id "${RDZV_ID:-fsdp_train}")
  else
    die "NNODES=$nnodes needs MASTER_ADDR: the address of one of the nodes, reachable from all of them" \
      "(it hosts the rendezvous on port $port)"
  fi
  local restarts=${MAX_RESTARTS:-0}
  [[ $restarts =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$restarts must be a whole number >= 0"
  if ((10#$restarts > 0)); then torchrun_cmd+=(--max-restarts "$((10#$restarts))"); fi
  torchrun_cmd+=(--nproc-per-node "$nproc" "$REPO_DIR/fsdp_train.py")
  if [[ -n ${EXPERIMENT:-} ]]; then torchrun_cmd+=(-e "$EXPERIMENT"); fi
  if [[ -n ${DATASET:-} ]]; then torchrun_cmd+=(-d "$DATASET"); fi
  if [[ -n ${MODEL:-} ]]; then torchrun_cmd+=(-m "$MODEL"); fi
  if [[ -n ${CONFIG:-} ]]; then
    [[ -f $CONFIG ]] || die "CONFIG=$CONFIG not found (relative paths start at the repository root $REPO_DIR)"
    torchrun_cmd+=(--config "$CONFIG")
  fi
  add_batch_args "$nnodes" "$nproc" "$@"
  torchrun_cmd+=("$@")
}

# --batch-size / --grad-accum-steps from MICRO_BATCH_SIZE and TOTAL_BATCH_SIZE. Args: nnodes nproc trainer-args...
add_batch_args() {
  local nnodes=$1 nproc=$2
  shift 2
  local micro=${MICRO_BATCH_SIZE:-} total=${TOTAL_BATCH_SIZE:-} conflict
  grad_accum_steps=
  [[ -n $micro || -n $total ]] || return 0
  conflict=$(find_batch_flag "$@")
  if [[ -n $conflict ]]; then
    die "$conflict in the arguments conflicts with TOTAL_BATCH_SIZE/MICRO_BATCH_SIZE, which set --batch-size" \
      "and --grad-accum-steps; drop $conflict or unset those variables"
  fi
  if [[ -z $micro ]]; then
    local config
    config=$(config_file "$@") || exit 2
    [[ -n $config ]] || die "TOTAL_BATCH_SIZE=$total needs the per-process micro-batch: set MICRO_BATCH_SIZE"
    micro=$(config_value "$config" batch-size) || exit 2
    [[ -n $micro ]] || die "TOTAL_BATCH_SIZE=$total needs the per-process micro-batch: set MICRO_BATCH_SIZE" \
      "(the config $config has no batch-size)"
    [[ $micro =~ ^[0-9]+$ ]] && ((10#$micro > 0)) || die "the config $config's batch-size ($micro) must be a positive integer"
  fi
  require_positive_int MICRO_BATCH_SIZE "$micro"
  micro=$((10#$micro))
  torchrun_cmd+=(--batch-size "$micro")
  [[ -n $total ]] || return 0
  require_positive_int TOTAL_BATCH_SIZE "$total"
  total=$((10#$total))
  local world=$((nnodes * nproc)) degree groups
  degree=$(context_degree "$@") || exit 2
  groups="$world processes ($nnodes nodes x $nproc)"
  if ((degree > 1)); then
    ((world % degree == 0)) || die "--context-parallel $degree does not divide the $world processes" \
      "($nnodes nodes x $nproc); choose a degree that divides NNODES x NPROC_PER_NODE"
    groups="$((world / degree)) data-parallel groups ($world processes / --context-parallel $degree)"
  fi
  derive_grad_accum_steps "$total" "$micro" "$((world / degree))" "$groups"
  torchrun_cmd+=(--grad-accum-steps "$grad_accum_steps")
}

# Defaults for the training processes; anything already set in the environment wins.
export_runtime_env() {
  # The toolkit is offline: fail fast instead of hanging on hub timeouts from a node without internet.
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
  export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
  # HF tokenizers' thread pool can deadlock once a DataLoader forks (and warns about it); ranks are the parallelism.
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
  # Split this node's cores between its ranks (torchrun would otherwise pin every rank to 1 thread).
  local cores threads
  cores=$(nproc 2>/dev/null || echo 1)
  threads=$((cores / nproc_per_node))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
  # On an NCCL error or timeout, abort the process instead of hanging: the job then fails and can be resumed.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN} # INFO when diagnosing: prints the transport (IB/socket) and interfaces
  # NCCL picks the network interface itself. If the bootstrap picks a wrong one (docker0, a management NIC;
  # symptom: a hang or "connection refused" at the first collective), name the right one, e.g.
  #   export NCCL_SOCKET_IFNAME=ib0      (or eth0, or ^docker0,lo to exclude)
  # and for InfiniBand NCCL_IB_HCA=mlx5 restricts the adapters used.
  # FSDP all-gathers blocks of varying size every layer; expandable segments keep the allocator from fragmenting.
  if [[ -z ${PYTORCH_CUDA_ALLOC_CONF:-} && -z ${PYTORCH_ALLOC_CONF:-} ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  fi
  # Only used when torchrun itself gets SIGTERM (scancel, preemption): how long it lets the ranks finish a
  # checkpoint before SIGKILL. torch < 2.12 ignores it and waits 30 s.
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
  # torchrun keeps one store for all restarts of a group; across nodes the trainer cannot tell the restarts apart
  # in it (fsdp_lib/runtime.py, restart_safe_store), so every restart gets a fresh one.
  if ((10#${NNODES:-1} > 1)); then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}; fi
}

# Set by the traps, so wait_for_exit can tell "a signal interrupted wait" from "the child exited".
signal_arrived=0

# Wait until process $1 has exited; its exit status goes to child_status. A trapped signal makes `wait` return
# early (status > 128) with the child still running, so wait again.
wait_for_exit() {
  local pid=$1 status
  child_status=
  while :; do
    signal_arrived=0
    status=0
    wait "$pid" || status=$?
    # 127: already reported by the previous round (a signal landed just after the child exited).
    if [[ $status == 127 && -n $child_status ]]; then return 0; fi
    child_status=$status
    if [[ $signal_arrived == 0 ]]; then return 0; fi
  done
}

# Ctrl-C at a terminal reaches this script and torchrun together (one foreground process group); torchrun
# forwards SIGINT to the ranks, which save and exit. Adding a SIGTERM here would make that SIGINT the ranks'
# second stop signal, which fsdp_train.py takes as "stop now, without saving".
on_interrupt() {
  signal_arrived=1
  log "got SIGINT: torchrun passes it to the training processes, which save and exit"
}

# Ask the training processes to save and exit: SIGTERM to torchrun's children (the ranks), not to torchrun.
request_stop() {
  signal_arrived=1
  if pkill -TERM -P "$torchrun_pid" 2>/dev/null; then
    log "got SIG$1: sent SIGTERM to the training processes; they save at the next step boundary and exit"
  else
    # No ranks yet (torchrun is still in rendezvous): stopping torchrun itself loses nothing.
    log "got SIG$1 before the training processes started: stopping torchrun"
    kill -TERM "$torchrun_pid" 2>/dev/null || true
  fi
}

run_torchrun() {
  # torchrun and the ranks inherit "ignore SIGUSR1": in a Slurm step every process receives the signal,
  # and only this script should act on it (torchrun would die from it and orphan the ranks).
  trap '' USR1
  "$@" &
  torchrun_pid=$!
  trap 'request_stop USR1' USR1
  trap 'request_stop TERM' TERM
  trap on_interrupt INT
  wait_for_exit "$torchrun_pid"
  trap - USR1 TERM INT
  log "torchrun exited with status $child_status"
  return "$child_status"
}

main() {
  prepare_launch "$@"
  export_runtime_env
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    print_command "${torchrun_cmd[@]}"
    return 0
  fi
  log "world size $world_size${grad_accum_steps:+, grad-accum-steps $grad_accum_steps}; running: $(print_command "${torchrun_cmd[@]}")"
  run_torchrun "${torchrun_cmd[@]}"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
