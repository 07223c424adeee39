export PYTHONPATH=. PYTHONUNBUFFERED=1
for cfg in "" "--stage-bytes 40960 --stage-target 131072" "--stage-bytes 40960 --stage-target 81920" "--stage-bytes 10240"; do
  for only in "Nk128k D128" "B64"; do
    timeout 100 python3 bench/experiments/sweep_gpu_decode.py $cfg --only "$only" --splits 1 2 4 8 16 --repetitions 5 2>&1 | grep -v "copy bandwidth"
  done
done
