# Sourced by the experiment scripts (exp_six_workers.sh, netns_three_hosts.sh).
# wait_for WHAT PID LOG SECONDS COMMAND... : poll until COMMAND succeeds; fail at once if PID has exited (printing the
# end of LOG), or once SECONDS have passed.
wait_for() {
  local what=$1 pid=$2 log=$3 limit=$4 t0=$SECONDS; shift 4
  until "$@" > /dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "$what exited before it answered; the end of $log:" >&2; tail -n 5 "$log" >&2; exit 1; fi
    if (( SECONDS - t0 > limit )); then echo "$what did not come up within $limit s; see $log" >&2; exit 1; fi
    sleep 0.5
  done
}
