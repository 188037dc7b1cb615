#!/usr/bin/env bash
# Launch recipe: the TP-4 DSpark drafter sidecar on one node, beside a TP-4 engine.
#
#   deploy/launch-tp4.sh [more `dspark-sidecar serve` flags ...]
#
# It sets up the environment below, creates the socket directory, and then becomes the
# server (exec): SIGTERM drains it and it exits 0; under DSPARK_LAUNCHER=torchrun the ranks drain
# as well, but torchrun's agent exits 1 (it reports the signal as its own failure, with a traceback),
# so a supervisor counts that stop as failed. Flags given here win over DSPARK_* env,
# except --tp and --socket-dir, which are refused: set DSPARK_TP and DSPARK_SOCKET_DIR.
#
# Environment read here (all optional):
#   DSPARK_LAUNCHER      builtin (default: `serve` spawns the rank processes) | torchrun
#   DSPARK_TP            number of ranks, default 4: the engine's TP size
#   DSPARK_SOCKET_DIR    rank r listens on unix:$DSPARK_SOCKET_DIR/rank{r}.sock
#                        (default /tmp/dspark-sidecar); the engine must use the same dir
#   DSPARK_SOCKET_GROUP  group that owns the socket dir (setgid, so the 0660 sockets are
#                        the engine's to open); default: this user's group
#   DSPARK_DEVICE        auto (default) | cpu | cuda; cpu skips all GPU set-up below
#   DSPARK_PYTHON        interpreter with dspark_sidecar installed (default python3)
#   Every other DSPARK_<FLAG> (checkpoint, backend, metrics port, ...) is read by the server.
#
# Environment an operator sets on GPU nodes, identical to the engine's:
#   AMD      HIP_VISIBLE_DEVICES=0,1,2,3   rank r runs on the r-th GPU of this list, which
#                                          must be the engine's list in the engine's order
#   NVIDIA   CUDA_VISIBLE_DEVICES=0,1,2,3  same rule; CUDA_DEVICE_ORDER=PCI_BUS_ID (default
#                                          here) so both processes number GPUs alike
#            CUDA_MPS_PIPE_DIRECTORY       the running MPS daemon's pipe dir (default
#                                          /tmp/nvidia-mps); without MPS every step pays a
#                                          GPU context switch between the two processes
#   NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME default lo: the ranks' collectives and their
#                                          bootstrap stay on this node (RCCL reads NCCL_*)
#   OMP_NUM_THREADS                        host threads per rank, default 2
set -euo pipefail

log() { printf 'launch-tp4: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# Set but empty (`DSPARK_SOCKET_DIR=$UNSET_VAR`) is refused, as serve refuses it (cli._env): these two reach
# serve as flags, so taken for unset here they would silently become the defaults.
for var in DSPARK_TP DSPARK_SOCKET_DIR; do
  [[ ${!var-x} ]] || die "$var is set but empty: unset it for the default or give a value"
done
launcher=${DSPARK_LAUNCHER:-builtin}
tp=${DSPARK_TP:-4}
socket_dir=${DSPARK_SOCKET_DIR:-/tmp/dspark-sidecar}
device=${DSPARK_DEVICE:-auto}
python=${DSPARK_PYTHON:-python3}

[[ $tp =~ ^[1-9][0-9]*$ ]] || die "DSPARK_TP must be a positive integer, got '$tp'"
case $launcher in
  builtin | torchrun) ;;
  *) die "DSPARK_LAUNCHER must be builtin or torchrun, got '$launcher'" ;;
esac
command -v "$python" >/dev/null || die "no interpreter '$python' (set DSPARK_PYTHON)"
# --tp and --socket-dir come from DSPARK_TP and DSPARK_SOCKET_DIR only: torchrun's process count and
# the folder prepared below are taken from them, and a flag appended after ours would win in serve
# alone (torchrun: N processes serving another --tp; a folder served that was never prepared).
for arg in "$@"; do
  case $arg in
    --tp | --tp=*) die "--tp: set DSPARK_TP instead (it also sizes torchrun)" ;;
    # argparse takes any unique prefix of a flag: --so, --sock=D, --socket-d D are all --socket-dir.
    --so | --so=* | --soc*) die "--socket-dir: set DSPARK_SOCKET_DIR instead (the folder is prepared here)" ;;
  esac
done
export DSPARK_TP=$tp DSPARK_SOCKET_DIR=$socket_dir

# Which GPUs, if any: the device nodes say more than any tool that may be missing.
vendor=none
if [[ $device != cpu ]]; then
  if [[ -e /dev/kfd ]]; then
    vendor=amd
  elif [[ -e /dev/nvidiactl ]]; then
    vendor=nvidia
  fi
fi

case $vendor in
  amd)
    if [[ -z ${HIP_VISIBLE_DEVICES:-}${ROCR_VISIBLE_DEVICES:-}${CUDA_VISIBLE_DEVICES:-} ]]; then
      log "warning: HIP_VISIBLE_DEVICES unset: rank r takes the node's GPU r; set the engine's list"
    fi
    ;;
  nvidia)
    export CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
    # Set but empty hides every GPU: under --device auto the ranks would serve on the CPU.
    if [[ -z ${CUDA_VISIBLE_DEVICES+set} ]]; then
      log "warning: CUDA_VISIBLE_DEVICES unset: rank r takes the node's GPU r; set the engine's list"
    elif [[ -z $CUDA_VISIBLE_DEVICES ]]; then
      die "CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible; set the engine's list, or DSPARK_DEVICE=cpu"
    fi
    # A client that starts while no daemon answers silently runs without MPS.
    if ! command -v nvidia-cuda-mps-control >/dev/null ||
      ! echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; then
      log "warning: no MPS daemon on $CUDA_MPS_PIPE_DIRECTORY: each step pays a context switch"
    fi
    ;;
  none) ;;
esac

export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# Missing parents as `serve` makes them (server/sockdir.py: 0755, narrowed by the caller's umask),
# before the umask below: under it they were 0770 in this user's own group, which the engine's
# DSPARK_SOCKET_GROUP could not pass through to reach the sockets.
# A folder that cannot be made or handed over is a setting to mend (exit 2, as serve's refusal of it), not
# set -e's exit 1, which a unit's Restart= takes for a crash and retries; the tool's own line says why above ours.
(umask "$(printf '%04o' $(($(umask) | 8#022)))" && mkdir -p -- "$(dirname -- "$socket_dir")") ||
  die "DSPARK_SOCKET_DIR: cannot make the parents of $socket_dir"
# Never through a link of another user's: serve refuses one (server/sockdir.py: its owner can point it
# elsewhere), but only after the chmod and chgrp below had followed it, opening to the group whatever folder
# of this user's it named (a member of a group-writable parent's group, which serve accepts, can plant one).
entry=$socket_dir
while [[ $entry == */ && $entry != / ]]; do entry=${entry%/}; done  # "dir/" would name the link's target
if [[ -L $entry ]]; then
  owner=$(stat -c %u -- "$entry")
  [[ $owner == "$EUID" || $owner == 0 ]] ||
    die "DSPARK_SOCKET_DIR: $entry is a symbolic link owned by another user (uid $owner), who could point it elsewhere; give the folder itself"
fi
# Sockets are created 0660 by the server; the directory admits only its owner and group.
umask 007
mkdir -p -- "$socket_dir" || die "DSPARK_SOCKET_DIR: cannot make $socket_dir"
if [[ -O $socket_dir ]]; then
  chmod 0770 -- "$socket_dir" || die "DSPARK_SOCKET_DIR: cannot set the mode of $socket_dir"
fi
if [[ -n ${DSPARK_SOCKET_GROUP:-} ]]; then
  { chgrp -- "$DSPARK_SOCKET_GROUP" "$socket_dir" && chmod 2770 -- "$socket_dir"; } ||
    die "DSPARK_SOCKET_GROUP: cannot give $socket_dir to group '$DSPARK_SOCKET_GROUP' (does it exist, and is this user in it?)"
fi

log "launcher=$launcher tp=$tp gpus=$vendor sockets=$socket_dir/rank{0..$((tp - 1))}.sock"
if [[ $launcher == torchrun ]]; then
  # One process per rank; each serves only its own RANK (no spawning).
  exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$tp" \
    -m dspark_sidecar serve --tp "$tp" --socket-dir "$socket_dir" "$@"
fi
exec "$python" -m dspark_sidecar serve --tp "$tp" --socket-dir "$socket_dir" "$@"
