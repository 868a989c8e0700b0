#!/bin/bash
# On the lent H100/H200: FlashInfer's own unit tests against an sm_90 wheel of ours, JIT off.
# W: the carried folder (default .whl) holding the wheels and fitests/ (FlashInfer's tests, these
# scripts); IDS: the node-id list in fitests/ (default ids.txt); PICK="N_BUILT N_MISSING FILE...":
# write IDS first with pick_xqa.py (a sample of tests whose module is in the wheel, and of some
# whose module is not); PYTEST_LIMIT: seconds for the test run (default 420).
set -o pipefail
W=${W:-$PWD/.whl}
IDS=${IDS:-ids.txt}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $W/apache_tvm_ffi-*.whl $W/flashinfer_python-*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE=/tmp/jit-empty FLASHINFER_JIT_CACHE_REPORT_FILE=$OUT/missing.json
mkdir -p /tmp/jit-empty && chmod 555 /tmp/jit-empty
nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
python3 - <<'PY' 2>&1 | tee $OUT/load.txt
import ctypes, os, pathlib, flashinfer, tvm_ffi
from flashinfer.jit import env
aot = pathlib.Path(flashinfer.__file__).parent / "data" / "aot"
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
for d in sorted(aot.iterdir()):
    arts = env.get_aot_artifacts(d.name)
    # Binding every symbol now: one the link left unbound (a driver call) fails here, not mid-test.
    ctypes.CDLL(str(d / f"{d.name}.so"), mode=os.RTLD_NOW)
    tvm_ffi.load_module(str(d / f"{d.name}.so"))
    print("loaded", d.name, "found" if arts and str(arts[0].path).startswith(str(aot)) else "NOT FOUND")
PY
cd $W/fitests
if [ -n "$PICK" ]; then
    python3 pick_xqa.py $IDS $PICK 2>&1 | tail -n 8 || exit 1
    cp $IDS $IDS.tsv $OUT/
fi
timeout ${PYTEST_LIMIT:-420} python3 run_ids.py $IDS -q -rs -p no:cacheprovider -n 8 --junitxml=$OUT/junit.xml 2>&1 | tee $OUT/pytest.log | tail -n 60
echo "jit dir after: $(ls -A /tmp/jit-empty | wc -l) entries, $(find /tmp/jit-empty -type f | wc -l) files"; find /tmp/jit-empty | head -n 20
# Each module's cubin archs and its kernel count (a module whose kernels were compiled out would show 0).
for so in /tmp/site/flashinfer/data/aot/*/*.so; do echo "$(basename $so): $(cuobjdump --list-elf $so | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')$(cuobjdump -res-usage $so 2>/dev/null | grep -c Function) kernels"; done | tee $OUT/archs.txt
