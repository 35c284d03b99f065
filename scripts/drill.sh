#!/usr/bin/env bash
# Reliability drill (issue 17): tries to make Tessera lose work, as a careful user would.
#   1. kill -9 at random moments of a run saving every step (1 device, 4 simulated devices,
#      and with --mpi 2 MPI ranks), resuming after each kill: after every kill the checkpoint
#      on disk must verify, and the finished run must equal an uninterrupted one bit for bit
#      (the per-tensor checksums of their last checkpoints are compared);
#   2. flipped bytes at a random offset of every file of a 1-device and a sharded checkpoint:
#      `tessera checkpoint verify` and `tessera train --resume` must both refuse each;
#   3. a full file system (a small tmpfs, in a user namespace): a run that could not save is
#      refused before step 1, and a disk filled up during a run fails that save clearly while
#      the previous checkpoint stays intact (it verifies) and the failed save leaves nothing;
#   4. misuse (issue 43): exports onto the checkpoint, a directory holding it, the working
#      directory, its parent or another checkpoint (with --force), a --save over another run's
#      checkpoint or a directory of other files, loads of a checkpoint whose manifest or
#      config.json was tampered with (eval, generate, train --init), --init with --resume:
#      each must be refused, and every file there before must be byte-identical after (sha256);
#      output flags onto a symbolic link, a FIFO and `-` must write through them, keep them
#      what they were, and leave no temporary file.
# Prints one JSON object of figures on stdout (progress on stderr); exits non-zero when any
# check fails.
#
# usage: scripts/drill.sh [--bin PATH] [--kills N] [--steps S] [--mpi] [--seed N]
#   --bin    the tessera binary (default: target/release/tessera, built if missing)
#   --kills  kills per configuration (default 4)
#   --steps  training steps per run (default 8)
#   --mpi    also drill a 2-rank MPI run (needs mpirun: scripts/setup.sh installs it)
set -euo pipefail
cd "$(dirname "$0")/.."

bin=target/release/tessera kills=4 steps=8 mpi=0 seed=$RANDOM
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --mpi) mpi=1; shift ;;
    --seed) seed=$2; shift 2 ;;
    *) echo "drill: unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$bin" ]; then cargo build --release -q -p tessera-cli; fi
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
RANDOM=$seed
work=$(mktemp -d "${TMPDIR:-/tmp}/tessera-drill.XXXXXX")
# The main shell's alone: a subshell killed just after its fork (the watchdog below, when a kill
# lands at start-up and the run ends at once) can still run the EXIT trap it inherited, and it
# removed the work directory under the drill (seen in one test run of 2, under load).
main_shell=$$
trap '[ "$BASHPID" = "$main_shell" ] && rm -rf "$work"' EXIT
say() { echo "drill: $*" >&2; }
fail() { echo "drill: FAILED: $*" >&2; exit 1; }

# A small run: gpt2-tiny, a few steps, a save after every step.
run_args=(train --model gpt2-tiny --batch 4 --seq 32 --eval-batches 0 --save-every 1
          --format json)
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_ALLOW_RUN_AS_ROOT=1 \
       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
train() { # train CONFIG SAVE_DIR STEPS [extra args...]
  local cfg=$1 dir=$2 n=$3; shift 3
  local -a pre dev
  case $cfg in
    one) pre=("$bin"); dev=(--devices 1) ;;
    four) pre=("$bin"); dev=(--devices 4 --plan "dp2 tp2") ;;
    mpi) pre=(mpirun --allow-run-as-root --oversubscribe --bind-to none -n 2 "$bin")
         dev=(--plan dp2) ;;
  esac
  "${pre[@]}" "${run_args[@]}" "${dev[@]}" --steps "$n" --save "$dir" "$@"
}
# The tessera processes of a run saving to DIR (every rank under mpirun, not mpirun itself).
procs() { pgrep -f -- "^$bin .*--save $1( |\$)" || true; }
# The step a checkpoint is at (0 when there is none).
step_of() { python3 -c '
import json, sys
try: print(json.load(open(sys.argv[1] + "/manifest.json"))["step"])
except Exception: print(0)' "$1"; }
# Per-tensor checksums of a checkpoint, file by file (what bit-exact means here).
tensor_sums() { python3 -c '
import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
print(json.dumps({f: d.get("tensors", {}) for f, d in m["checksums"].items() if f.endswith(".safetensors")}, sort_keys=True))' "$1"; }
# Bytes of tensor data that differ between two checkpoints (tensor by tensor, file by file;
# headers aside, whose metadata order is not fixed).
differing_bytes() { python3 -c '
import json, os, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in head.items() if k != "__metadata__"}
a, b = sys.argv[1:3]
lost = 0
for root, _, files in os.walk(b):
    for f in files:
        if f.endswith(".safetensors"):
            rel = os.path.relpath(os.path.join(root, f), b)
            x, y = tensors(os.path.join(a, rel)), tensors(os.path.join(b, rel))
            for name in set(x) | set(y):
                p, q = x.get(name, b""), y.get(name, b"")
                lost += sum(i != j for i, j in zip(p, q)) + abs(len(p) - len(q))
print(lost)' "$1" "$2"; }
verify() { "$bin" checkpoint verify "$1" >/dev/null 2>"$work/verify.err"; }

configs=(one four)
[ "$mpi" = 1 ] && configs+=(mpi)
kills_done=0 kills_survived=0 verified_after_kill=0 resumes_exact=0 bytes_lost=0

# ---- 1. kill -9 during --save-every 1 ----------------------------------------------------------
for cfg in "${configs[@]}"; do
  say "$cfg: reference run"
  train "$cfg" "$work/ref-$cfg" "$steps" >/dev/null 2>"$work/ref.err" || fail "$cfg reference: $(tail -3 "$work/ref.err")"
  dir=$work/run-$cfg
  for ((k = 0; k < kills; k++)); do
    at=$(step_of "$dir")
    [ "$at" -ge "$steps" ] && break
    resume=(); [ "$at" -gt 0 ] && resume=(--resume "$dir")
    train "$cfg" "$dir" "$steps" "${resume[@]}" >/dev/null 2>"$work/kill.err" &
    pid=$!
    # A random moment: start-up, a step, or the middle of a save. Moments are chosen by the
    # run's progress, not by the clock, so they land before the run ends on any machine: a
    # third at start-up, the rest a few milliseconds after a random saved step short of the last.
    if [ $((RANDOM % 3)) = 0 ]; then
      sleep "0.0$((RANDOM % 9 + 1))"
    else
      target=$((at + RANDOM % (steps - at)))
      while [ "$(step_of "$dir")" -lt "$target" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.02; done
      sleep "0.0$((RANDOM % 6))"
    fi
    victims=($(procs "$dir"))
    landed=0
    if [ ${#victims[@]} -gt 0 ] && kill -9 "${victims[$((RANDOM % ${#victims[@]}))]}" 2>/dev/null; then
      landed=1
    fi
    # A watchdog: OpenMPI's mpirun can hang when a rank dies while it is still launching the
    # others (seen once in 15 kills). After 60 s whatever runs with this save directory —
    # mpirun included — is killed too; the checks below are the same either way.
    ( sleep 60; pkill -9 -f -- "--save $dir( |\$)" ) >/dev/null 2>&1 &
    dog=$!
    wait "$pid" 2>/dev/null || true
    kill "$dog" 2>/dev/null || true
    now=$(step_of "$dir")
    if [ "$landed" = 0 ]; then
      say "$cfg: the run had ended (step $now of $steps) before kill $((k + 1))"
      continue
    fi
    kills_done=$((kills_done + 1))
    # No half-written checkpoint is ever visible: what is there verifies.
    if [ "$now" -gt 0 ]; then
      verify "$dir" || fail "$cfg: after kill $((k + 1)) the checkpoint does not verify: $(cat "$work/verify.err")"
      verified_after_kill=$((verified_after_kill + 1))
    fi
    kills_survived=$((kills_survived + 1))
    say "$cfg: kill $((k + 1)) at step $now of $steps"
  done
  at=$(step_of "$dir")
  if [ "$at" -lt "$steps" ]; then
    resume=(); [ "$at" -gt 0 ] && resume=(--resume "$dir")
    train "$cfg" "$dir" "$steps" "${resume[@]}" >/dev/null 2>"$work/finish.err" || fail "$cfg finishing: $(tail -3 "$work/finish.err")"
  fi
  lost=$(differing_bytes "$dir" "$work/ref-$cfg")
  bytes_lost=$((bytes_lost + lost))
  [ "$lost" = 0 ] && [ "$(tensor_sums "$dir")" = "$(tensor_sums "$work/ref-$cfg")" ] ||
    fail "$cfg: the resumed run differs from the uninterrupted one in $lost bytes"
  resumes_exact=$((resumes_exact + 1))
  rm -rf "$work/ref-$cfg"
done

# ---- 2. flipped bytes in every file ---------------------------------------------------------
corruptions=0 detected_verify=0 detected_resume=0
for cfg in one four; do
  src=$work/run-$cfg
  for rel in $(cd "$src" && find . -type f | sed 's|^\./||' | sort); do
    bad=$work/bad
    rm -rf "$bad"; cp -r "$src" "$bad"
    python3 - "$bad/$rel" "$RANDOM" <<'PY'
import os, random, sys
path, seed = sys.argv[1], int(sys.argv[2])
data = bytearray(open(path, "rb").read())
at = random.Random(seed).randrange(len(data))
for i in range(at, min(at + 16, len(data))):
    data[i] ^= 0x5A
open(path, "wb").write(data)
PY
    corruptions=$((corruptions + 1))
    if verify "$bad"; then fail "$cfg: verify missed flipped bytes in $rel"; fi
    detected_verify=$((detected_verify + 1))
    if train "$cfg" "$bad" $((steps + 1)) --resume "$bad" >/dev/null 2>"$work/resume.err"; then
      fail "$cfg: a resume from a checkpoint with flipped bytes in $rel succeeded"
    fi
    grep -q -e "$(basename "$rel")" "$work/resume.err" || fail "$cfg: the resume error does not name $rel: $(tail -2 "$work/resume.err")"
    detected_resume=$((detected_resume + 1))
  done
  say "$cfg: flipped bytes detected in every file"
done
rm -rf "$work/bad"

# ---- 4. misuse --------------------------------------------------------------------------------
misuse_cases=0 misuse_refused=0 misuse_lost=0
m=$work/misuse
mkdir -p "$m/runs"
tiny=(--devices 1 --steps 1 --batch 2 --seq 16 --eval-batches 0)
( cd "$m" && "$bin" train "${tiny[@]}" --save runs/ck1 && "$bin" train "${tiny[@]}" --seed 7 --save runs/ck2 ) \
  >/dev/null 2>"$work/misuse.err" || fail "misuse setup: $(tail -3 "$work/misuse.err")"
echo "my notes" >"$m/runs/notes.txt"
mkdir -p "$m/mine" && echo '{}' >"$m/mine/tokenizer.json"
cp -r "$m/runs/ck1" "$m/bad-manifest" && echo '{}' >"$m/bad-manifest/manifest.json"
cp -r "$m/runs/ck1" "$m/flipped-manifest"
python3 - "$m/flipped-manifest/manifest.json" "$m/runs/ck1/config.json" "$m/bad-config/config.json" <<'PY'
import json, os, sys
flip, src, dst = sys.argv[1:4]
data = bytearray(open(flip, "rb").read()); data[len(data) // 2] ^= 0x01
open(flip, "wb").write(data)
config = json.load(open(src)); config["layer_norm_epsilon"] = 0.5
os.makedirs(os.path.dirname(dst), exist_ok=True)
for f in os.listdir(os.path.dirname(src)):
    if f != "config.json":
        open(os.path.join(os.path.dirname(dst), f), "wb").write(open(os.path.join(os.path.dirname(src), f), "rb").read())
json.dump(config, open(dst, "w"), indent=2)
PY
hashes() { (cd "$m" && find . -type f ! -name '.*.lock' -print0 | sort -z | xargs -0 sha256sum); }
hashes >"$work/misuse.before"
refused() { # refused DESCRIPTION SAYS COMMAND...: the command must fail (in $m), saying SAYS
  local what=$1 says=$2; shift 2
  misuse_cases=$((misuse_cases + 1))
  if (cd "$m" && "$@") >/dev/null 2>"$work/misuse.err"; then fail "misuse: $what succeeded"; fi
  grep -q -e "$says" "$work/misuse.err" || fail "misuse: $what: the error does not say \"$says\": $(tail -2 "$work/misuse.err")"
  misuse_refused=$((misuse_refused + 1))
}
refused "export onto a directory holding the checkpoint" "holds the checkpoint being exported" "$bin" export --checkpoint runs/ck1 --hf runs --force
refused "export onto the checkpoint itself" "is the checkpoint being exported" "$bin" export --checkpoint runs/ck1 --hf runs/ck1 --force
refused "export onto the working directory" "the working directory" env -C "$m/mine" "$bin" export --checkpoint ../runs/ck1 --hf "$m/mine" --force
refused "export onto the working directory's parent" "--force never" "$bin" export --checkpoint runs/ck1 --hf "$(dirname "$m")" --force
refused "export onto another checkpoint" "is a Tessera checkpoint" "$bin" export --checkpoint runs/ck1 --hf runs/ck2 --force
refused "export onto a directory of other files" "files an export did not write" "$bin" export --checkpoint runs/ck1 --hf mine --force
refused "train --save over another run's checkpoint" "--overwrite-save" "$bin" train "${tiny[@]}" --save runs/ck2
refused "train --save over a directory of other files" "not a Tessera checkpoint" "$bin" train "${tiny[@]}" --save runs
refused "train --init with --resume" "both say where the run starts" "$bin" train "${tiny[@]}" --init runs/ck1 --resume runs/ck2
for bad in bad-manifest flipped-manifest bad-config; do
  refused "eval of $bad" "${bad#*-}.json" "$bin" eval --model-dir "$bad" --tokens 1,2,3,4
  refused "generate from $bad" "${bad#*-}.json" "$bin" generate --model-dir "$bad" --prompt hi --max-new-tokens 2
  refused "train --init $bad" "${bad#*-}.json" "$bin" train "${tiny[@]}" --init "$bad"
done
hashes >"$work/misuse.after"
misuse_lost=$(diff "$work/misuse.before" "$work/misuse.after" | grep -c '^<' || true)
[ "$misuse_lost" = 0 ] || fail "misuse: files changed or lost: $(diff "$work/misuse.before" "$work/misuse.after" | head -5)"
# Output flags: through a symbolic link, into a FIFO, to standard output.
o=$m/out
mkdir -p "$o/real" && echo old >"$o/real/plan.json" && ln -s real/plan.json "$o/link.json" && mkfifo "$o/fifo"
plan=(plan --model gpt2-tiny --cluster 2xcpu --format json)
misuse_cases=$((misuse_cases + 3))
"$bin" "${plan[@]}" --out "$o/link.json" >/dev/null 2>"$work/misuse.err" || fail "misuse: plan --out a link: $(tail -2 "$work/misuse.err")"
[ -L "$o/link.json" ] && grep -q '"version"' "$o/real/plan.json" || fail "misuse: plan --out a link did not write through it"
cat "$o/fifo" >"$work/fifo.out" &
reader=$!
"$bin" "${plan[@]}" --out "$o/fifo" >/dev/null 2>"$work/misuse.err" || fail "misuse: plan --out a FIFO: $(tail -2 "$work/misuse.err")"
wait "$reader"
[ -p "$o/fifo" ] && grep -q '"version"' "$work/fifo.out" || fail "misuse: plan --out a FIFO did not write into it"
"$bin" "${plan[@]}" --out - 2>"$work/misuse.err" | grep -q '"version"' || fail "misuse: plan --out - wrote nothing to stdout"
stray=$(find "$m" -name '*tmp*' | head -3)
[ -z "$stray" ] || fail "misuse: temporary files left: $stray"
say "misuse: $misuse_refused refused, every file kept; output flags wrote through a link, a FIFO and stdout"
rm -rf "$m"

# ---- 3. full file systems ---------------------------------------------------------------------
ckpt_bytes=$(du -sb "$work/run-one" | cut -f1)
full_disk_checks=0
disk_drill() { # runs inside a private mount namespace with a tmpfs at $work/fs
  local fs=$work/fs
  # (a) room for one checkpoint but not the two a --save-every run needs: refused at once.
  mount -t tmpfs -o size=$((ckpt_bytes * 3 / 2)) tmpfs "$fs"
  if train one "$fs/ck" "$steps" >"$work/out.json" 2>"$work/disk.err"; then echo "a: trained"; return 1; fi
  grep -q "free but one checkpoint of this run needs" "$work/disk.err" || { echo "a: $(cat "$work/disk.err")"; return 1; }
  # Only the lock file of the directory may be there (it stays, by design).
  local left; left=$(ls -A "$fs" | grep -v '^\.ck\.lock$' || true)
  [ -z "$left" ] || { echo "a: left $left"; return 1; }
  umount "$fs"
  # (b) the disk fills up during the run: that save fails, the previous checkpoint stays.
  mount -t tmpfs -o size=$((ckpt_bytes * 5 / 2 + 4194304)) tmpfs "$fs"
  train one "$fs/ck" $((steps * 4)) >/dev/null 2>"$work/disk.err" &
  local pid=$!
  while [ "$(step_of "$fs/ck")" -lt 1 ] && kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  dd if=/dev/zero of="$fs/filler" bs=1M status=none 2>/dev/null || true
  if wait "$pid"; then echo "b: the run did not notice the full disk"; return 1; fi
  grep -qi "no space left" "$work/disk.err" || { echo "b: $(tail -2 "$work/disk.err")"; return 1; }
  verify "$fs/ck" || { echo "b: $(cat "$work/verify.err")"; return 1; }
  rm -f "$fs/filler"
  left=$(ls -A "$fs" | grep -v '^ck$' | grep -v '^\.ck\.lock$' || true)
  [ -z "$left" ] || { echo "b: the failed save left $left"; return 1; }
  return 0
}
mkdir -p "$work/fs"
export -f disk_drill train step_of verify
export work bin steps ckpt_bytes run_args_s="${run_args[*]}"
if ! unshare -rm true 2>/dev/null; then
  fail "unshare -rm (a user and mount namespace, to mount a small tmpfs) is not allowed here: the full-disk drill cannot run"
fi
out=$(unshare -rm bash -c 'read -r -a run_args <<<"$run_args_s"; disk_drill' 2>&1) ||
  fail "full disk: $out"
full_disk_checks=2
say "full disks: refused before step 1, and a save that hit a full disk kept the previous checkpoint"

cat <<JSON
{"seed": $seed, "configurations": "$(IFS=,; echo "${configs[*]}")", "steps": $steps,
 "kills": $kills_done, "kills_survived": $kills_survived, "verified_after_kill": $verified_after_kill,
 "resumes_bit_exact": $resumes_exact, "corruptions": $corruptions,
 "detected_by_verify": $detected_verify, "detected_by_resume": $detected_resume,
 "full_disk_checks": $full_disk_checks, "bytes_lost": $bytes_lost,
 "misuse_cases": $misuse_cases, "misuse_refused": $misuse_refused, "misuse_lost": $misuse_lost}
JSON
