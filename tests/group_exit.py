"""Run under `mlx.launch -n 2`: rank 1 exits (code 3) once both ranks met; rank 0 waits in a
collective that rank 1 never joins. What `mlx.launch` does then is what tests look at."""

import os
import sys
import time

import mlx.core as mx

group = mx.distributed.init(backend="ring")
mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group, stream=mx.cpu))
print(f"rank {group.rank()} met", flush=True)
if group.rank() == 1:
    os._exit(3)
time.sleep(0.5)
try:
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group, stream=mx.cpu))
    print("rank 0 collective returned", flush=True)
except Exception as e:  # the test reads what happened
    print(f"rank 0 collective raised {type(e).__name__}", flush=True)
time.sleep(30)
print("rank 0 outlived its peer", flush=True)
sys.exit(0)
