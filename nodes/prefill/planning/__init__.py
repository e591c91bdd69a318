"""What a prefill node plans and predicts: loads and slots (`loads.py`, `plan.py`), the budget
and activation reserve, the RAM tier's size, the cost model (`cost.py`, `work.py`) and the
rates it is calibrated with."""
