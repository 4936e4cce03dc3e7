set -e
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY'
from pathlib import Path
from benchmarks.quality.reap_quality import write_data
Path("/tmp/d").mkdir(exist_ok=True)
print(write_data(Path("/tmp/d")))
PY
F=tests/fixtures/tiny-moe-trained
for run in a b; do
  /usr/bin/time -f "reap $run: %e s, %M KB" python3 -m kconvert reap $F /tmp/$run --data /tmp/d/calib.jsonl --keep 12 --samples 64 --seq-len 256 --repair router --compensate learned --device cuda -v 2>&1 | grep -E "repair:|reap |wrote|applied|GPU memory" | tail -12
done
for f in /tmp/a/*.safetensors /tmp/a/reap-plan.json; do cmp $f /tmp/b/$(basename $f) && echo "same $(basename $f)"; done
python3 -m kconvert reap $F /tmp/c --data /tmp/d/calib.jsonl --keep 12 --samples 64 --seq-len 256 --repair router --compensate down --device cuda --quiet
python3 -m kconvert eval $F /tmp/c /tmp/a --data /tmp/d/held.jsonl --samples 64 --seq-len 256 --dtype float32 --device cuda -o $OUT/eval 2>&1 | tail -6
cp /tmp/a/reap-plan.json $OUT/plan_learned_cuda.json
