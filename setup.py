"""`app/` and `nodes/` install as `tandem.app` and `tandem.nodes` (pyproject.toml has the rest).

`tandem` itself is a namespace package: its folder holds one module, `__main__.py` (`python -m
tandem`), and no `__init__.py`, so a checkout run from its root joins the installed package
instead of shadowing it.
"""

from setuptools import find_packages, setup

TOPS = ("app", "nodes")
packages = [f"tandem.{p}" for p in find_packages(include=[f"{t}*" for t in TOPS])]
setup(packages=["tandem", *packages], package_dir={f"tandem.{t}": t for t in TOPS})
