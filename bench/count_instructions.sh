#!/usr/bin/env bash
# Load-independent companion to bench_core.py: CPU instructions per indexing
# operation (valgrind's cachegrind), Shape vs NumPy on the same 4-d index.
# Timings on a shared machine swing by 2x; instruction counts do not.
# Usage: bench/count_instructions.sh   (needs valgrind; run from the repo root)
set -euo pipefail
PY=$(python -c 'import sys; print(sys.executable)')
SCRIPT=$(mktemp --suffix=.py)
trap 'rm -f "$SCRIPT"' EXIT
cat > "$SCRIPT" <<'PYEOF'
import sys
import numpy as np
from mesharray import Shape
s = Shape(hosts=4, gpus=5, x=6, y=7)
a = np.arange(s.size).reshape(s.sizes)
which, expr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = {"mesharray": s, "numpy": a}[which]
exec(compile(f"for _ in range({n}): {expr}", "<bench>", "exec"), {"x": x, "np": np})
PYEOF
count() {
  PYTHONPATH=. PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
    "$PY" "$SCRIPT" "$@" 2>&1 | awk '/I *refs/ {gsub(",", "", $NF); print $NF}'
}
printf "%-28s %12s %12s %7s\n" "index" "mesharray" "numpy" "ratio"
for expr in 'x[0]' 'x[:, -1]' 'x[:, 1:4]' 'x[:, 1:5:2]' 'x[1, 2:5, ..., 6]' 'x[1, 2:5:2, ..., -1]' 'x[:, [0, 2, 4]]'; do
  declare -A per
  for impl in mesharray numpy; do
    lo=$(count "$impl" "$expr" 20000); hi=$(count "$impl" "$expr" 120000)
    per[$impl]=$(( (hi - lo) / 100000 ))
  done
  printf "%-28s %12s %12s %7.2f\n" "$expr" "${per[mesharray]}" "${per[numpy]}" \
    "$(python -c "print(${per[mesharray]} / ${per[numpy]})")"
done
