"""`app/` and `nodes/` install as `tandem.app` and `tandem.nodes` (pyproject.toml has the rest).

`tandem` itself is a namespace package with no folder of its own, so a checkout run from its
root cannot shadow the installed package.
"""

from setuptools import find_packages, setup

TOPS = ("app", "nodes")
packages = [f"tandem.{p}" for p in find_packages(include=[f"{t}*" for t in TOPS])]
setup(packages=packages, package_dir={f"tandem.{t}": t for t in TOPS})
