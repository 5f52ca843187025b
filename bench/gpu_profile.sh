#!/usr/bin/env bash
# Where each process of the daemon spends its time on a GPU host, in one call of a GPU
# session (the device tool): bench.gpu's compiled overlap run on 40,000 images (IMAGES),
# every process of it sampled by py-spy (collapsed stacks, RATE a second: 50, since 37
# samplers at 200 took the run to a third of its pace; active threads only,
# not paused: --nonblocking) from when the daemon's processes are up until it ends;
# prof.tgz (a stacks file and a log for each process id, ps.txt naming them), the
# bench's report and timeline into $OUT. py-spy travels in the packed site (.whl):
#
#   bench/gpu_session.sh wheels
#   run(command="bash bench/gpu_profile.sh", carry=[".whl"], timeout_s=240)
#
# LOCAL=1 (no install), SPY (py-spy's path) and BENCH_FLAGS (for --compile) try it
# without a GPU: BENCH_FLAGS="--quick --device cpu".
# (py-spy's --subprocesses does not follow the fork server's children, so each process
# is sampled by a py-spy of its own.)
set -u
if [ -z "${LOCAL:-}" ]; then
    python3 -m tarfile --filter data -e .whl/site.tar.xz /tmp/site || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SPY=${SPY:-/tmp/site/bin/py-spy}
rm -rf /tmp/prof /tmp/bp; mkdir -p /tmp/prof
began=$(date +%s)
timeout 200 python3 -m bench.gpu --only overlap --images ${IMAGES:-40000} ${BENCH_FLAGS:---compile} --out /tmp/bp \
    >"$OUT/bench.log" 2>&1 &
bench=$!
tree() { for c in $(pgrep -P "$1"); do echo "$c"; tree "$c"; done; }
# The daemon's processes: the fork server's children, one a core and the model's. Not
# the compiler's workers, which the model compiled alone (measured first) starts.
children() {
    for p in $(tree "$bench"); do
        grep -qa "multiprocessing.forkserver" "/proc/$p/cmdline" 2>/dev/null && pgrep -P "$p"
    done
}
for _ in $(seq 1 300); do
    [ "$(children | wc -l)" -ge $(($(nproc) + 1)) ] && break
    sleep 0.5
done
pids="$(tree "$bench")"
echo "children up after $(($(date +%s) - began)) s: $(echo $pids | wc -w) processes"
ps -o pid,ppid,args -p "$(echo $pids | tr ' ' ,)" >/tmp/prof/ps.txt
for p in $pids; do
    timeout 190 "$SPY" record --pid "$p" --rate "${RATE:-50}" --nonblocking --format raw \
        --duration 180 -o "/tmp/prof/$p.txt" >"/tmp/prof/$p.log" 2>&1 &
done
wait "$bench"
echo "bench exit $? after $(($(date +%s) - began)) s"
sleep 2
pkill -INT -f "py-spy record" ; sleep 3
tar czf "$OUT/prof.tgz" -C /tmp prof
cp /tmp/bp/timeline.png "$OUT/" 2>/dev/null
cp /tmp/bp/report.json "$OUT/" 2>/dev/null
grep -h '^{"' "$OUT/bench.log" | cut -c1-500
ls -la "$OUT"
