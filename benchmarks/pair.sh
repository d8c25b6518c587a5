# Sourced by the benchmark scripts that run zerojax and its PyTorch anchor one after the other:
#   run_pair NAME ZEROJAX_SCRIPT ZEROJAX_TIMEOUT_S TORCH_SCRIPT TORCH_TIMEOUT_S
# runs both (--tiny when SMOKE is set), logs each to $OUT (default benchmarks/results/) and prints
# their JSON lines ({"framework": ...}) at the end.
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
TINY=""
[ -n "${SMOKE:-}" ] && TINY="--tiny"

run_pair() {
    local name=$1 zj=$2 zj_s=$3 anchor=$4 anchor_s=$5 stamp
    stamp=$(date +%Y%m%d-%H%M%S)
    echo "== zerojax $name"
    timeout "$zj_s" $PY "$zj" $TINY 2>&1 | tee "$OUT/$name-zerojax-$stamp.log" | grep -v "^WARNING"
    echo "== PyTorch + transformers $name"
    timeout "$anchor_s" $PY "$anchor" $TINY 2>&1 | tee "$OUT/$name-hf-$stamp.log" | grep -v "^WARNING"
    echo "== JSON lines"
    grep -h '^{"framework"' "$OUT/$name-zerojax-$stamp.log" "$OUT/$name-hf-$stamp.log"
}
