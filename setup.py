"""Installs the repository's folders as one package, `tandem`: app/ -> tandem.app, runtime/ ->
tandem.runtime, models/ -> tandem.models, ext/ -> tandem.ext; nothing generic lands at the top of
site-packages. Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

LAYERS = ["app", "runtime", "models", "ext"]


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        # the root folder is the `tandem` package: its only module is __init__.py, not this file
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if package != "tandem" or m[1] == "__init__"]


setup(
    packages=["tandem", *(f"tandem.{p}" for p in find_packages(include=[f"{n}*" for n in LAYERS]))],
    package_dir={"tandem": "."},
    cmdclass={"build_py": BuildPy},
)
