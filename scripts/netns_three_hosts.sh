#!/usr/bin/env bash
# Three "hosts" as network namespaces joined by veth pairs (a star around the coordinator):
#
#   bt-host1 (10.77.1.2) ---veth--- (10.77.1.1) bt-coord (10.77.2.1) ---veth--- (10.77.2.2) bt-host2
#
# The coordinator runs in bt-coord, two workers in each of bt-host1 and bt-host2 (B=4 blocks).
# Every veth end is capped with tbf at RATE_MBIT. Latency: netem adds RTT_MS/4 per veth end
# egress when the kernel has it; otherwise (CONFIG_NET_SCH_NETEM unset, as on the machine the
# committed results come from) a userspace relay in bt-coord (benchmarks/distributed/delay_relay.py) adds
# RTT_MS/2 in each direction. Writes benchmarks/results/three-hosts.json.
# HIVEMIND=1: the coordinator hosts the run's DHT (--hivemind) and the workers average on hivemind
# (--averaging hivemind); host1 and host2 reach each other through bt-coord (routed, both veths capped, but
# the userspace relay delays only the coordinator's HTTP: without netem, peer-to-peer traffic gets no latency).
# Every run records the bytes each host's veth end moved (all its traffic, headers included) in host-bytes.json.
#
#   flock /tmp/blocktrain-cpu.lock scripts/netns_three_hosts.sh          # set up, run, tear down
#   scripts/netns_three_hosts.sh up | down                               # only set up / tear down
#
# Needs root (ip netns, tc); without root it prints SKIP and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then echo "SKIP: needs root for 'ip netns' and 'tc' (run with sudo)"; exit 0; fi
for t in ip tc; do command -v "$t" > /dev/null || { echo "SKIP: '$t' not found (install iproute2)"; exit 0; }; done

PRESET=${PRESET:-cpu-mini}
OBJECTIVE=${OBJECTIVE:-diffusion}  # or stack: blocks open in turn, the four workers follow the open block
SUFFIX=$([ "$OBJECTIVE" = diffusion ] && echo "" || echo "-$OBJECTIVE")
H=${H:-25}
ROUNDS=${ROUNDS:-12}
RTT_MS=${RTT_MS:-40}
RATE_MBIT=${RATE_MBIT:-50}
DATA=${DATA:-$(cd ../shared/data/wikitext/wikitext-2-v1-tokens && pwd)}  # the shared WikiText-2 beside the repository
HIVEMIND=${HIVEMIND:-0}
[ "$HIVEMIND" = 1 ] && SUFFIX="$SUFFIX-hivemind"
OUT=${OUT:-runs/exp-three-hosts$SUFFIX}
NS_C=bt-coord; NS_1=bt-host1; NS_2=bt-host2
PY=$(pwd)/.venv/bin/python
BT="$PY -m blocktrain"

source scripts/wait_for.sh  # wait_for WHAT PID LOG SECONDS COMMAND... (the working directory is the repository)

down() {
  for ns in $NS_C $NS_1 $NS_2; do ip netns del "$ns" 2> /dev/null || true; done
}

up() {
  down
  for ns in $NS_C $NS_1 $NS_2; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
  for i in 1 2; do
    ns="bt-host$i"
    ip link add "bt-c$i" type veth peer name "bt-h$i"
    ip link set "bt-c$i" netns $NS_C
    ip link set "bt-h$i" netns "$ns"
    ip -n $NS_C addr add "10.77.$i.1/24" dev "bt-c$i"
    ip -n "$ns" addr add "10.77.$i.2/24" dev "bt-h$i"
    ip -n $NS_C link set "bt-c$i" up
    ip -n "$ns" link set "bt-h$i" up
    ip -n "$ns" route add default via "10.77.$i.1"  # the other host is reached through bt-coord
  done
  ip netns exec $NS_C sysctl -q -w net.ipv4.ip_forward=1
  NETEM=0
  if ip netns exec $NS_C tc qdisc add dev bt-c1 root netem delay 1ms 2> /dev/null; then
    ip netns exec $NS_C tc qdisc del dev bt-c1 root; NETEM=1
  fi
  for i in 1 2; do
    for pair in "$NS_C bt-c$i" "bt-host$i bt-h$i"; do
      set -- $pair
      if [ $NETEM = 1 ]; then
        ip netns exec "$1" tc qdisc add dev "$2" root netem delay "$((RTT_MS / 4))ms" rate "${RATE_MBIT}mbit"
      else
        ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "${RATE_MBIT}mbit" burst 64kb latency 400ms
      fi
    done
  done
  echo $NETEM > /tmp/bt-netns-netem
  echo "namespaces up (netem: $NETEM, rate ${RATE_MBIT} mbit/s per veth end)"
}

run() {
  up
  trap 'kill $(jobs -p) 2> /dev/null || true; down' EXIT
  NETEM=$(cat /tmp/bt-netns-netem)
  rm -rf "$OUT"; mkdir -p "$OUT/logs"
  for i in 0 1 2 3; do $BT token add "w$i" --run-dir "$OUT/run" > "$OUT/w$i.token"; done
  if [ "$NETEM" = 1 ]; then
    LISTEN=0.0.0.0; CPORT=8470; EMUL="netem delay $((RTT_MS / 4)) ms per veth end"
  else
    LISTEN=127.0.0.1; CPORT=8471; EMUL="userspace relay (benchmarks/distributed/delay_relay.py), $((RTT_MS / 2)) ms each way"
    ip netns exec $NS_C "$PY" benchmarks/distributed/delay_relay.py --listen 10.77.1.1:8470 --listen 10.77.2.1:8470 \
      --target "127.0.0.1:$CPORT" --delay-ms "$((RTT_MS / 2))" 2> "$OUT/logs/relay.log" &
  fi
  ip netns exec $NS_C env OMP_NUM_THREADS=1 $BT coordinator --run-dir "$OUT/run" --preset "$PRESET" --objective "$OBJECTIVE" \
    --steps $((ROUNDS * H)) --data "$DATA" --host $LISTEN --port $CPORT --rounds "$ROUNDS" --round-seconds 300 \
    --lease-seconds 120 --eval-every 2 --eval-bytes 8192 --threads 1 --local-steps "$H" \
    $([ "$HIVEMIND" = 1 ] && echo "--hivemind --hivemind-host 0.0.0.0") 2> "$OUT/logs/coordinator.log" &
  # bounded, and given up at once if the coordinator exits (the exit trap ends every job and removes the namespaces)
  wait_for "the coordinator" $! "$OUT/logs/coordinator.log" 120 ip netns exec $NS_1 curl -sf "http://10.77.1.1:8470/v1/status"
  RTT=$(ip netns exec $NS_1 "$PY" benchmarks/distributed/measure_rtt.py "http://10.77.1.1:8470/" --n 30)
  echo "{\"rtt_ms\": $(echo "$RTT" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["rtt_ms_median"])'),
    \"rtt_note\": \"median of 30 small HTTP GETs from bt-host1 to the coordinator over a kept-alive connection\",
    \"rate_mbit\": $RATE_MBIT, \"latency_emulation\": \"$EMUL\"}" > "$OUT/net.json"
  host_bytes() {  # rx+tx bytes of each host's veth end
    for i in 1 2; do ip -n "bt-host$i" -j -s link show "bt-h$i"; done | "$PY" -c '
import json, sys
rows = [json.loads(line)[0]["stats64"] for line in sys.stdin if line.strip()]
print(json.dumps([{"rx": r["rx"]["bytes"], "tx": r["tx"]["bytes"]} for r in rows]))'
  }
  BYTES0=$(host_bytes)
  t0=$(date +%s)
  PIDS=()
  for i in 0 1 2 3; do
    h=$(( i % 2 + 1 ))
    ip netns exec "bt-host$h" env OMP_NUM_THREADS=1 BLOCKTRAIN_TOKEN="$(cat "$OUT/w$i.token")" $BT worker \
      --coordinator "http://10.77.$h.1:8470" --local-steps "$H" --data "$DATA" --threads 1 --no-progress \
      --frozen-cache "$OUT/frozen-cache-host$h" --summary-json "$OUT/w$i.summary.json" \
      $([ "$HIVEMIND" = 1 ] && echo "--averaging hivemind --p2p-host 10.77.$h.2") 2> "$OUT/logs/w$i.log" &
    PIDS+=($!)
  done
  for p in "${PIDS[@]}"; do wait "$p"; done
  echo $(( $(date +%s) - t0 )) > "$OUT/wall_s"
  echo "{\"before\": $BYTES0, \"after\": $(host_bytes), \"workers_per_host\": 2}" > "$OUT/host-bytes.json"
  sleep 3
  ip netns exec $NS_1 curl -sf "http://10.77.1.1:8470/v1/status" > "$OUT/status.json"
  "$PY" benchmarks/distributed/collect_distributed.py three-hosts "$OUT" --preset "$PRESET" --h "$H" --rounds "$ROUNDS" \
    --objective "$OBJECTIVE" --out "${RESULT:-benchmarks/results/three-hosts$SUFFIX.json}" \
    --command "${RESULT:+RESULT=$RESULT }OBJECTIVE=$OBJECTIVE PRESET=$PRESET H=$H ROUNDS=$ROUNDS RTT_MS=$RTT_MS RATE_MBIT=$RATE_MBIT HIVEMIND=$HIVEMIND flock /tmp/blocktrain-cpu.lock scripts/netns_three_hosts.sh"
}

case "${1:-run}" in
  up) up ;;
  down) down ;;
  run) run ;;
  *) echo "usage: $0 [run|up|down]"; exit 2 ;;
esac
