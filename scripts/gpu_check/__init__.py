"""`scripts/gpu-check`'s modules: the sizes, the sections (each run in a child process of its
own), the runner of those children, and the report. The script bootstraps an uninstalled
checkout (`checkout.use_checkout`) before it imports this package."""
