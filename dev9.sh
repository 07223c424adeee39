export PYTHONPATH=$PWD
timeout 330 python bench/experiments/sweep_gpu_tiles.py --dims 96,80,112 --n 4096,16384 --only 192x128x2,256x64x2,128x64x2/2,128x128x2/2 > $OUT/sweep.txt 2>&1
grep -E "^\| [0-9]|best" $OUT/sweep.txt
