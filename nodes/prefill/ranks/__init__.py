"""Two devices or more in one prefill node (issue 52): each rank streams and computes its
share of every layer (`shard.py`), the ranks sum their shares with torch.distributed
(`collective.py`), and rank 0 serves while the others follow its passes (`follower.py`)."""
