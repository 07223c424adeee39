export PYTHONPATH=. PYTHONUNBUFFERED=1 TILEATTN_HYPOTHESIS_PROFILE=device
timeout 100 python3 -m pytest tests/test_output_buffers.py -q -n 8 -p no:cacheprovider 2>&1 | tail -2
timeout 120 python3 -c "
import sys; sys.path.insert(0, 'bench')
import bench_gpu_decode as b
b.overhead()
" 2>&1 | tail -5
timeout 60 python3 bench/experiments/overhead_gpu.py 2>&1 | head -2
