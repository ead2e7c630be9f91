#!/usr/bin/env bash
# Third device call: the matmul ceiling for perf_notes.md, head-dim-256 backward configs
# (issue 7), FlexAttention on two shapes (issue 4) and the launch-overhead check of the
# ablation's setting B (tools/ladder_probe.py's overhead section).
set -u
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
R=/tmp/h200; mkdir -p $R; export OUT_DIR=$R
pack() { tar czf $OUT/h200.tgz -C $R . ; }
trap pack EXIT
echo "== $(date +%T) matmul ceiling"
python3 - <<'PY' 2>&1 | tee $R/matmul_ceiling.txt
import torch, triton.testing
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
print(f"bf16 8192^3 matmul: {ms:.4f} ms, {2 * 8192**3 / ms / 1e9:.1f} TFLOP/s, {torch.cuda.get_device_name()}, torch {torch.__version__}")
PY
echo "== $(date +%T) head dim 256 backward configs"
timeout 80 python3 tools/tune_fa2.py --seqlens 4096 --hdims 256 --passes bwd \
  --bwd-configs 64,64,64,64,4,2 64,32,128,16,8,2 32,32,128,16,8,2 64,32,128,32,8,2 > $R/tune256.log 2>&1; echo "rc=$?"; mv $OUT/tune_fa2.csv $R/tune_fa2_d256_bwd.csv 2>/dev/null; tail -8 $R/tune256.log; pack
echo "== $(date +%T) launch overhead, setting B"
timeout 50 python3 tools/ladder_probe.py --skip timings correctness candidates --budget-s 40 > $R/overhead.log 2>&1; echo "rc=$?"; cp $OUT/probe_overhead.csv $R/ 2>/dev/null; tail -12 $R/overhead.log; pack
echo "== $(date +%T) flex attention"
timeout 70 python3 runner.py --suite paper --dtype bf16 --providers flex-attention,sdpa-flash --modes fwd --hdims 128 \
  --seqlens 2048,8192 --out $R/flex > $R/flex.log 2>&1; echo "rc=$?"; tail -8 $R/flex.log
echo "== $(date +%T) done"
