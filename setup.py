"""Maps the top-level folders runtime/, tools/, evals/ into the one import package ``freetoken_agent``.

Metadata lives in pyproject.toml; this file only computes the package list, so adding a sub-package never
needs an edit here.
"""

from setuptools import find_packages, setup

ROOTS = {
    "freetoken_agent": "freetoken_agent",
    "freetoken_agent.runtime": "runtime",
    "freetoken_agent.tools": "tools",
    "freetoken_agent.evals": "evals",
}

packages: list[str] = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
