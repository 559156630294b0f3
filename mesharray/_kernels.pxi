# _kernels: see _core.pyx
