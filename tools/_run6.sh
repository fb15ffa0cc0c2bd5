#!/bin/bash
source .gpu/env.sh
export MLA_KERNELS_CACHE_DIR=/tmp/mkc
git log --oneline | head -1
python tools/bench.py --ops fwd --shapes v32-h128-kv8k,v32-h128-kv32k,v32-h64-kv32k --no-ref --peers .peers --b2b 10 2>&1 | grep -v Warn | tail -14
python tools/bench_decode.py --reps 30 --no-fwd 2>&1 | grep -v Warn | tail -16
python -m pytest --co -q -p no:cacheprovider tests/test_sm90_fwd.py 2>/dev/null | grep "::" > /tmp/ids
rm -f /tmp/shard_*; split -n r/4 /tmp/ids /tmp/shard_
for f in /tmp/shard_a?; do (python -m pytest -q -p no:cacheprovider $(cat $f) 2>&1 | tail -1 > $f.out) & done
wait; cat /tmp/shard_*.out
