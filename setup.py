"""The package list, found rather than written out, so that a new folder cannot be left out
of a wheel. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

# NOTE: conf/ and stages/ stay top-level folders of the repository (the project's layout) and
# install inside the package as pcpflow.conf and pcpflow.stages, with their subfolders.
MAPPED = {"pcpflow.conf": "conf", "pcpflow.stages": "stages"}


def mapped_packages(name: str, folder: str) -> list[str]:
    return [name, *(f"{name}.{sub}" for sub in find_packages(folder))]


setup(
    packages=find_packages(include=["pcpflow", "pcpflow.*"])
    + [p for name, folder in MAPPED.items() for p in mapped_packages(name, folder)],
    package_dir=MAPPED,
)
