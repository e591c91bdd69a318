"""A decode node as a group of `mx.distributed` ranks started by `mlx.launch` (issue 38): the
model's layers split by pipeline across the ranks (`split.py`: contiguous ranges sized by each
rank's memory; `pipeline.py`: each rank loads and runs only its own)."""
