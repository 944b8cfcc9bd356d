"""The one native part, the hot-load loop (src/ckptstream/_engine/hotloop.c): optional, so that an
install without a C compiler still succeeds (the engine's Python loop then runs)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptstream._engine._hotloop", ["src/ckptstream/_engine/hotloop.c"],
                             extra_compile_args=["-O2", "-Wall", "-Werror"], optional=True)])
