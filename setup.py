"""Build script: maps the top-level stage folders into the one `stack` import namespace.

`data/` installs as `stack.data`, `models/` as `stack.models`, and so on, so no generic
top-level module named `data` or `models` lands in anyone's site-packages. Metadata and
dependencies live in pyproject.toml.
"""

from setuptools import find_packages, setup

# import name -> folder in the repository
PACKAGE_ROOTS = {
    "stack": "stack",
    "stack.data": "data",
    "stack.models": "models",
    "stack.train": "train",
    "stack.deploy": "deploy",
}


def all_packages() -> list[str]:
    """Every package under each mapped root, named in the `stack` namespace."""
    names = []
    for name, folder in PACKAGE_ROOTS.items():
        names.append(name)
        names.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return names


setup(
    packages=all_packages(),
    package_dir=PACKAGE_ROOTS,
)
