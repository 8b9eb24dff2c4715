"""The compiled suffix tree (services/drafter/_suffix_tree.cpp); everything else is in pyproject.toml.

The extension is optional: without a C++ compiler the install goes on and the Python reference
tree serves (services/drafter/suffix_tree.py: new_tree).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "services.drafter._suffix_tree",
            ["services/drafter/_suffix_tree.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
