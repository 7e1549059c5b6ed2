#!/usr/bin/env bash
# Lethe on a GPU: the device-independent tests and the real-model benches on CUDA in bfloat16.
#
#   make real-model && bash scripts/gpu-check.sh            # on a machine with a CUDA GPU
#   DEVICE=cpu DTYPE=bfloat16 QUICK=1 bash scripts/gpu-check.sh   # the same path on the CPU, a quick run
#
# Writes docs/gpu/ (bench JSON and markdown, the GPU's name, pytest's summary). The tests that use the model
# fixtures (`tiny_lm`, `real_lm`) load on LETHE_TEST_DEVICE / LETHE_TEST_DTYPE; the others are CPU-only by
# nature (file formats, the HTTP layer) and are left to `make test`. The fused tilt kernel (numba) is CPU-only:
# on CUDA the head runs as tensor operations.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
DTYPE="${DTYPE:-bfloat16}"
MODEL="${MODEL:-models/smollm2-135m-instruct}"
OUT="${OUT:-docs/gpu}"
PY="${PY:-.venv/bin/python}"
LETHE="${LETHE:-.venv/bin/lethe}"
mkdir -p "$OUT"

"$PY" - "$DEVICE" > "$OUT/device.txt" <<'PYEOF'
import sys, torch
device = sys.argv[1]
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("gpu-check: CUDA is not available to this torch build (%s)" % torch.__version__)
    print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
else:
    print(device, "| torch", torch.__version__)
PYEOF
cat "$OUT/device.txt"

LETHE_TEST_DEVICE="$DEVICE" LETHE_TEST_DTYPE="$DTYPE" "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_decode.py tests/test_t3.py tests/test_tilt.py tests/test_server.py tests/test_real_model.py \
    2>&1 | tee "$OUT/pytest.txt"

if [ -n "${QUICK:-}" ]; then
    real_args=(--limit 3 --seeds 0 --temperatures 1.0); t3_args=(--repeats 2)
else
    real_args=(); t3_args=()
fi
# the speed bench's sets: the capitals to forget, the other fact kinds to keep (heads/evaluation/facts.py, all subjects)
"$LETHE" bench t3 --forget docs/real-sets/forget.jsonl --retain docs/real-sets/retain.jsonl --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" "${t3_args[@]}" --out "$OUT/bench-t3.json"
"$LETHE" bench real --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" "${real_args[@]}" --out "$OUT/bench-real.json"
echo "gpu-check: done; figures in $OUT"
