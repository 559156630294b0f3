# _shape: see _core.pyx
