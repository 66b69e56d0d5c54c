#!/usr/bin/env bash
# The online comparison of docs/benchmarks.md in one command: each row's server started alone
# on the idle machine, the same `iterserve bench serve` load against it, then stopped.
#
#   scripts/bench_online.sh [mixed|long-prompt] [rows...]
#   rows: 1 (defaults) 2 (no chunked prefill) 3 (static batching) hf (transformers serve
#         --continuous-batching on the converted default model; --plain requests)
# Results: bench-results/online/<workload>/serve-*.json and .png, one per row, and the
# summary lines on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
workload="${1:-mixed}"
shift || true
rows=("${@:-1 2 3 hf}")
read -r -a rows <<< "${rows[*]}"
bin=.venv/bin
port=8500
out="bench-results/online/$workload"
mkdir -p "$out"
if [ "$workload" = long-prompt ]; then max_len=4608; else max_len=2048; fi

wait_ready() {  # url, pid
    for _ in $(seq 600); do
        if curl -sf "$1" > /dev/null; then return 0; fi
        kill -0 "$2" 2> /dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    echo "server not ready after 600 s" >&2
    return 1
}

run_row() {  # label, bench flags, server command...
    local label="$1" flags="$2"
    shift 2
    "$@" > "$out/$label.server.log" 2>&1 &
    local pid=$!
    if wait_ready "http://127.0.0.1:$port/v1/models" "$pid"; then
        # shellcheck disable=SC2086
        "$bin/iterserve" bench serve --url "http://127.0.0.1:$port" --workload "$workload" \
            --concurrency 32 --label "$label" --no-progress --output-dir "$out" $flags
    fi
    kill -TERM "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
}

for row in "${rows[@]}"; do
    case "$row" in
        1) run_row row1 "" "$bin/iterserve" serve --port "$port" ;;
        2) run_row row2 "" "$bin/iterserve" serve --port "$port" --no-enable-chunked-prefill \
               --max-model-len "$max_len" --max-num-batched-tokens "$max_len" ;;
        3) run_row row3 "" "$bin/iterserve" serve --port "$port" --batching static ;;
        hf)
            model_dir=$("$bin/python" -c \
                'from iterserve.models.loader import resolve_model_dir; print(resolve_model_dir("default"))')
            run_row hf "--plain" "$bin/transformers" serve --continuous-batching \
                --dtype bfloat16 --device cpu --port "$port" "$model_dir" ;;
        *) echo "unknown row $row" >&2; exit 2 ;;
    esac
done
